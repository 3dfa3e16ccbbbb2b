"""The plan's alternatives are structurally different, the conventional layout is always shown
with its simulated step, and `plan --candidates-csv` lists every enumerated candidate."""
from __future__ import annotations

import csv
import json

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.search.alternatives import (PARAMS_PER_TP_RANK, best_per_structure, conventional_layout,
                                                  structure)
from meshplan.planner.simulation.simulator import simulate_config

SPEC = "llama:layers=8,hidden=1024,heads=16,kv_heads=8,ffn=2816,vocab=32000"


def _config(**kw) -> ParallelConfig:
    base = dict(gpus=8, global_batch=16, tp=1, pp=1, dp=8, microbatch_size=1)
    return ParallelConfig(**{**base, **kw})


def test_zero_stage_micro_batch_and_a_lone_stages_schedule_are_not_structure():
    assert structure(_config(zero=0)) == structure(_config(zero=2, microbatch_size=2))
    assert structure(_config(dp=4, tp=2)) != structure(_config())
    two_stages = dict(pp=2, dp=4, global_batch=16)
    assert structure(_config(**two_stages, schedule="gpipe")) == structure(_config(**two_stages))
    assert structure(_config(**two_stages, schedule="interleaved", virtual_stages=2, microbatch_size=1)) != \
        structure(_config(**two_stages))
    kept = best_per_structure([_config(zero=1), _config(zero=0), _config(dp=4, tp=2)], lambda c: c)
    assert [(c.zero, c.tp) for c in kept] == [(1, 1), (0, 2)]


def test_the_conventional_layout_follows_megatrons_rule_and_the_simulator():
    h100 = load_cluster("h100-sxm")
    graph = profile("llama3-405b", 4096)
    conv = conventional_layout(graph, h100, 256, 256, "bf16-mixed", whole_model=False)
    cfg = conv.config
    assert cfg.tp == 8 and graph.total_params / 8 > PARAMS_PER_TP_RANK  # 405B: the largest tp in a node
    assert cfg.sp and cfg.zero == 1 and cfg.schedule == "1f1b" and cfg.microbatch_size == 1
    assert conv.prediction.fits
    again = simulate_config(graph, h100, cfg, chunk_of_layer=conv.chunk_of_layer,
                            recompute_of_layer=conv.recompute_of_layer)
    assert again.step_time_s == conv.prediction.step_time_s
    # pipeline stages only as memory needs them: no smaller pp fits, whatever the recomputation
    from meshplan.planner.simulation.estimator import estimate

    for pp in (p for p in (1, 2, 4, 8, 16) if p < cfg.pp):
        for recompute in ("none", "selective", "full"):
            assert not estimate("llama3-405b", h100, 256, 256, 4096, tp=8, pp=pp, zero=1, sp=True,
                                recompute=recompute).fits, (pp, recompute)
    assert cfg.pp > 1
    small = conventional_layout(profile(SPEC, 1024), h100, 8, 16, "bf16-mixed", whole_model=False)
    assert small.config.tp == 1 and small.config.pp == 1 and small.config.dp == 8  # 0.3B: data parallelism


def test_plan_alternatives_differ_in_structure_and_end_with_the_conventional_layout(run_cli, tmp_path):
    csv_path = tmp_path / "candidates.csv"
    code, out, err = run_cli("plan", "--model", SPEC, "--seq", "1024", "--cluster", "h100-sxm", "--gpus", "8",
                             "--gbs", "32", "--top", "4", "--json", "--candidates-csv", csv_path)
    assert code == 0, err
    data = json.loads(out)
    alternatives = data["alternatives"]
    conv = alternatives[-1]
    assert conv["conventional"].startswith("Megatron-LM") and conv["ilp_objective_s"] is None
    assert conv["prediction"]["step_time_s"] > 0 and conv["why_not"]
    shapes = [(m["pp"], m["dp"], m.get("cp", 1), m["tp"], m.get("ep", 1))
              for m in [data["mesh"]] + [a["mesh"] for a in alternatives[:-1]]]
    schedules = [data["schedule"]["name"]] + [a["schedule"]["name"] for a in alternatives[:-1]]
    keys = [(shape, sched if shape[0] > 1 else None) for shape, sched in zip(shapes, schedules)]
    assert len(set(keys)) == len(keys)  # no two differ only in ZeRO stage or micro-batch size
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == data["solver"]["num_candidates"]
    outcomes = [row["outcome"] for row in rows]
    assert outcomes.count("winner") == 1 and outcomes.count("alternative") == len(alternatives) - 1
    winner = rows[outcomes.index("winner")]
    assert float(winner["simulated_step_time_s"]) == pytest.approx(data["prediction"]["step_time_s"])
    pruned = sum(o.startswith("pruned: its compute lower bound") for o in outcomes)
    assert pruned == data["solver"]["num_pruned_bound"]
    assert all(o.split(":")[0] in ("winner", "alternative", "simulated", "solved", "pruned", "not reached")
               for o in outcomes)
    from meshplan.commands.plan import candidates_table

    table = candidates_table(data)
    assert list(table["note"]) == [""] * (len(table) - 1) + ["conventional"] and table["ILP ms"].iloc[-1] == "-"


@pytest.mark.parametrize("recomputed,text", [(1, "recomputing 1 layer:"), (3, "recomputing 3 layers:"),
                                             (0, "no recomputation:")])
def test_the_explanation_counts_recomputed_layers_in_good_english(recomputed, text):
    from meshplan.planner.search.assembly import explain

    plan_json = {"prediction": {"step_time_s": 1.0, "mfu": 0.5, "bubble_fraction": 0.0, "peak_memory_bytes": 2**30},
                 "solver": {"usable_memory_bytes": 2**31}, "mesh": {"pp": 1, "dp": 8, "tp": 1}, "sp": False,
                 "schedule": {"name": "1f1b", "virtual_stages": 1, "microbatches": 2, "microbatch_size": 1},
                 "zero": 1, "layers": [{"recompute": "full" if i < recomputed else "none"} for i in range(5)]}
    assert text in explain(plan_json)
