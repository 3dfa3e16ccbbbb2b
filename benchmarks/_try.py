import sys
sys.path.insert(0, '.')
import published_runs
from published_dgx_cloud_runs import dgx_cloud_grok1_runs
from fit_efficiency import predictions
from meshplan.planner.costing.hardware import load_cluster
for r in dgx_cloud_grok1_runs():
    if r.gpus not in (512,) : continue
    p = predictions(r, load_cluster(r.cluster))[0]
    b = p.breakdown
    print(r.name, r.cluster, r.published_step_s, round(p.step_time_s, 2), {k: round(v, 2) for k, v in (b.items() if isinstance(b, dict) else vars(b).items())})
