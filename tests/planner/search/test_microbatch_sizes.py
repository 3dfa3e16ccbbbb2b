"""Micro-batch sizes are searched up to what memory allows, with no silent cap: an image model
with a large global batch plans a step no slower than the best `estimate` of the layout it picks
over every micro-batch size; `max_mbs` (`plan --max-mbs`) limits them when asked."""
from __future__ import annotations

from pathlib import Path

import pytest

import meshplan
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.search.candidates import divisors
from meshplan.planner.search.request import PlanRequest

MODELS = Path(__file__).resolve().parents[3] / "benchmarks" / "models"
GPUS, GBS = 8, 4096


def _best_estimate_s(spec: str, plan) -> tuple[float, int]:
    """(the fastest step `estimate` predicts, its micro-batch size) over every micro-batch size
    of the plan's layout that fits."""
    config = plan.config
    best = (float("inf"), 0)
    for mbs in divisors(GBS // config.dp):
        prediction = meshplan.estimate(spec, "h100-sxm", GPUS, GBS, 1, tp=config.tp, pp=config.pp, mbs=mbs,
                                       zero=config.zero, schedule=config.schedule, precision=config.precision)
        if prediction.fits:
            best = min(best, (prediction.step_time_s, mbs))
    return best


@pytest.mark.parametrize("model", ["vit_b16.py:build", "resnet50.py:build"])
def test_image_model_plans_the_micro_batch_memory_allows(model):
    spec = f"{MODELS / model}"
    plan = meshplan.plan(spec, "h100-sxm", GPUS, GBS, 1, top_k=1)
    best_s, best_mbs = _best_estimate_s(spec, plan)
    assert best_mbs > 16  # the case the old cap of 16 missed
    assert plan.prediction["step_time_s"] <= best_s * (1 + 1e-6), (plan.config.microbatch_size, best_mbs)
    assert plan.config.microbatch_size > 16


def test_max_mbs_limits_the_micro_batch_size():
    spec = f"{MODELS / 'vit_b16.py:build'}"
    plan = meshplan.plan(spec, "h100-sxm", GPUS, GBS, 1, top_k=1, max_mbs=16)
    assert plan.config.microbatch_size == 16


def test_max_mbs_must_be_positive():
    assert PlanRequest.of("gpt2", "h100-sxm", 8, 64).max_mbs is None
    with pytest.raises(MeshplanError, match="--max-mbs must be a positive integer, got 0"):
        PlanRequest.of("gpt2", "h100-sxm", 8, 64, max_mbs=0)


def test_plan_max_mbs_flag_reaches_the_request(run_cli):
    code, _, err = run_cli("plan", "--model", "gpt2", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "64",
                           "--max-mbs", "0")
    assert code == 2
    assert "--max-mbs must be a positive integer, got 0" in err
