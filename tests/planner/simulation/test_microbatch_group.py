"""Interleaved 1F1B's micro-batch group size (`ParallelConfig.microbatch_group_size`, Megatron-Core's
--microbatch-group-size-per-virtual-pipeline-stage): the order, the memory it holds, plan.json and
the Megatron-LM export and import."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.plan import plan_from_json
from meshplan.planner.engines.bridge import export_plan, read_engine_text
from meshplan.planner.simulation.estimator import estimate
from meshplan.planner.simulation.schedules import max_in_flight, rank_actions
from tests.planner.engines.helpers import make_plan

SPEC = "gpt:layers=16,hidden=256,heads=4,vocab=1000"


def _config(**kwargs) -> ParallelConfig:
    base = dict(gpus=4, global_batch=16, pp=4, dp=1, schedule="interleaved", virtual_stages=2)
    return ParallelConfig(**{**base, **kwargs})


def test_the_default_group_is_stored_as_none_and_a_group_below_pp_or_not_dividing_is_refused():
    assert _config(microbatch_group_size=4).microbatch_group_size is None  # pp: Megatron-Core's default
    assert _config(microbatch_group_size=8).microbatch_group_size == 8
    assert "interleaved x2 group 8," in _config(microbatch_group_size=8).label()
    with pytest.raises(ValueError, match=r"at least pp \(4\)"):
        _config(microbatch_group_size=2)
    with pytest.raises(ValueError, match=r"divide the 16 micro-batches"):
        _config(microbatch_group_size=6)
    with pytest.raises(ValueError, match="--schedule interleaved"):
        _config(schedule="1f1b", virtual_stages=1, microbatch_group_size=8)


@pytest.mark.parametrize("group", [4, 8, 16])
def test_warm_up_is_megatron_cores_count(group):
    """Rank k runs (v - 1) N + 2 (p - 1 - k) warm-up forwards (Megatron-Core's count), then the
    steady state's forward before its first backward, which is the most it holds; the forwards go in
    rounds of N micro-batches per chunk (`get_schedule_table`)."""
    p, m, v = 4, 16, 2
    for rank in range(p):
        actions = rank_actions("interleaved", p, m, v, rank, group)
        before_first_backward = next(i for i, action in enumerate(actions) if action.kind == "B")
        assert before_first_backward == (v - 1) * group + 2 * (p - 1 - rank) + 1
        assert max_in_flight(actions) == before_first_backward
        forwards = [action.chunk // p for action in actions if action.kind == "F"]
        assert forwards[:2 * group] == [0] * group + [1] * group


def test_a_larger_group_holds_more_activations_in_the_simulator():
    """Rank 0 holds max_in_flight chunk-micro-batches: 11 at N = pp = 4, 15 at N = 8 (p 4, m 16, v 2)."""
    kwargs = dict(gpus=4, global_batch=16, seq=128, pp=4, schedule="interleaved", vpp=2, engine="megatron")
    default, larger = estimate(SPEC, "a100-80g", **kwargs), estimate(SPEC, "a100-80g", microbatch_group_size=8, **kwargs)
    assert larger.memory[0].activations > default.memory[0].activations
    held = [max_in_flight(rank_actions("interleaved", 4, 16, 2, 0, group)) for group in (None, 8)]
    assert held == [11, 15]


def test_plan_json_writes_the_group_only_when_set_and_megatron_round_trips_it():
    plan = make_plan(pp=2, dp=2, tp=2, schedule="interleaved", vpp=2, gbs=32, mbs=2)  # m = 8 per replica
    assert "microbatch_group_size" not in plan.to_json()["schedule"]  # older plans keep their digest
    grouped = replace(plan, config=replace(plan.config, microbatch_group_size=4, engine="megatron"))
    data = grouped.to_json()
    assert data["schedule"]["microbatch_group_size"] == 4
    assert plan_from_json(data).config.microbatch_group_size == 4
    assert grouped.digest != replace(plan, config=replace(plan.config, engine="megatron")).digest
    text = export_plan(grouped, "megatron").text
    assert "--microbatch-group-size-per-virtual-pipeline-stage 4" in text
    assert read_engine_text(text, "megatron").microbatch_group_size == 4
    default_text = export_plan(replace(plan, config=replace(plan.config, engine="megatron")), "megatron").text
    assert "--microbatch-group-size" not in default_text
    assert read_engine_text(default_text, "megatron").microbatch_group_size is None
