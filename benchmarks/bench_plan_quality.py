"""Plan quality: published hand-tuned configurations vs meshplan's plan, both predicted here.

Published layouts (evaluated with `planner.simulation.estimator.estimate`, best recomputation / ZeRO variant
that fits):
- Megatron-LM GPT scaling, Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM"), Table 1: seq 2048, vocab 51200, A100 80GB.
- Llama 3 405B at 8K sequence (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4):
  16384 H100, TP 8, CP 1, PP 16, DP 128, 16M tokens per step (2048 sequences).
meshplan's plan should be predicted no slower than the published one. Run:
`python benchmarks/bench_plan_quality.py [--all]` (default: the faster rows).
"""
from __future__ import annotations

import sys
import time

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.simulation.estimator import estimate
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile
from meshplan import plan

# name, spec, cluster, gpus, global batch, seq, published (tp, pp), schedule variants to try
GPT = "gpt:layers={},hidden={},heads={},vocab=51200,positions=2048"
ROWS = [
    ("GPT 1.7B (Table 1)", GPT.format(24, 2304, 24), "a100-80g", 32, 512, 2048, (1, 1)),
    ("GPT 7.5B (Table 1)", GPT.format(36, 4096, 32), "a100-80g", 128, 512, 2048, (4, 1)),
    ("GPT 39.1B (Table 1)", GPT.format(48, 8192, 64), "a100-80g", 512, 1536, 2048, (8, 2)),
    ("GPT 145.6B (Table 1)", GPT.format(80, 12288, 96), "a100-80g", 1536, 2304, 2048, (8, 8)),
    ("Llama 3 405B, 8K (Table 4)", "llama3-405b", "h100-sxm", 16384, 2048, 8192, (8, 16)),
]
FAST_ROWS = 3


def published(spec, cluster, gpus, gbs, seq, tp, pp):
    """The fastest fitting variant of the published mesh (mbs 1, as in both papers)."""
    best = None
    for recompute in ("none", "selective", "full"):
        for zero in (0, 1):
            schedules = [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 else [])
            for schedule, vpp in schedules:
                try:
                    pred = estimate(spec, cluster, gpus, gbs, seq, tp=tp, pp=pp, mbs=1, zero=zero,
                                    recompute=recompute, sp=tp > 1, schedule=schedule, vpp=vpp)
                except MeshplanError:
                    continue
                label = f"recompute {recompute}, ZeRO-{zero}, {schedule}"
                if pred.fits and (best is None or pred.step_time_s < best[0].step_time_s):
                    best = (pred, label)
    return best


def main(rows) -> None:
    print(f"{'configuration':<28} {'published step':>15} {'meshplan step':>14} {'ratio':>6}  meshplan layout")
    for name, spec, cluster_name, gpus, gbs, seq, (tp, pp) in rows:
        cluster = load_cluster(cluster_name)
        started = time.perf_counter()
        graph = profile(spec, seq, batch=1, dtype="bf16", attention="flash")
        ours = plan(spec, cluster, gpus, gbs, seq, graph=graph, top_k=3)
        plan_s = time.perf_counter() - started
        theirs = published(spec, cluster, gpus, gbs, seq, tp, pp)
        cfg = ours.config
        layout = (f"tp {cfg.tp} pp {cfg.pp} dp {cfg.dp}, {cfg.schedule}"
                  f"{' x' + str(cfg.virtual_stages) if cfg.virtual_stages > 1 else ''}, mbs {cfg.microbatch_size}, "
                  f"ZeRO-{cfg.zero} (planned in {plan_s:.0f} s)")
        step = ours.prediction["step_time_s"]
        if theirs is None:
            print(f"{name:<28} {'does not fit':>15} {step:13.3f}s {'':>6}  {layout}")
            continue
        print(f"{name:<28} {theirs[0].step_time_s:14.3f}s {step:13.3f}s {step / theirs[0].step_time_s:6.3f}  {layout}")
        print(f"{'':<28} published tp {tp} pp {pp} dp {gpus // (tp * pp)}: {theirs[1]}, "
              f"MFU {100 * theirs[0].mfu:.1f}% vs meshplan {100 * ours.prediction['mfu']:.1f}%")


if __name__ == "__main__":
    main(ROWS if "--all" in sys.argv else ROWS[:FAST_ROWS])
