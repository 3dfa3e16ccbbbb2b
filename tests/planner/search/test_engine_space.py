"""The search space follows the engine that runs the plan: under `--engine megatron` a traced
mixture of experts (DeepSeek-V2-Lite) gets expert parallelism, which meshplan's own executor does
not run for such models, and the unpinned search is no slower than the search pinned to any EP
degree, as a search over a superset must be (up to the ILPs' relative gap, 0.5% here, the
tolerance HiGHS's MIP gap and the re-ranking's rounding leave)."""
from __future__ import annotations

import pytest

from meshplan.planner.search.driver import search_plan

# 8 GPUs, where an EP degree wins; on 16 and more, data parallelism alone is the faster plan
# (the all-to-alls carry top_k copies of every token).
JOB = dict(spec="deepseek-v2-lite", cluster="h100-sxm", gpus=8, global_batch=256, seq=4096)


def _plan(**options):
    job = dict(JOB)
    return search_plan(job.pop("spec"), job.pop("cluster"), job.pop("gpus"), job.pop("global_batch"), job.pop("seq"),
                       top_k=1, **options)


@pytest.fixture(scope="module")
def unpinned():
    pytest.importorskip("transformers")
    return _plan(engine="megatron").to_json()


def test_another_engine_gets_expert_parallelism_and_its_best_degree(unpinned):
    assert unpinned["mesh"].get("ep", 1) > 1 and "num_executor_limited" not in unpinned["solver"]
    step_s = unpinned["prediction"]["step_time_s"]
    for ep in (2, 4, 8):
        pinned = _plan(engine="megatron", ep=ep).to_json()
        assert step_s <= pinned["prediction"]["step_time_s"] * 1.005, ep


def test_the_default_engine_keeps_to_the_executor_and_says_what_it_left_out():
    pytest.importorskip("transformers")
    own = _plan().to_json()
    assert own["mesh"].get("ep", 1) == 1 and own["mesh"]["tp"] == 1
    assert own["solver"]["num_executor_limited"] > 0


@pytest.mark.parametrize("engine,runs", [("megatron", {"1f1b", "interleaved"}), ("deepspeed", {"1f1b"})])
def test_a_plan_for_an_engine_holds_only_schedules_that_engine_runs(engine, runs):
    """Llama 3 8B on 16 H100 pinned to 4 stages: meshplan's executor's plan lists zero-bubble
    schedules, which neither Megatron-LM nor DeepSpeed runs; planned for them, every layout the
    plan lists uses one of theirs, and pinning one they do not run is refused in one line."""
    from meshplan.planner.contracts.errors import MeshplanError

    job = ("llama3-8b", "h100-sxm", 16, 64, 4096)
    own = search_plan(*job, top_k=3, pp=4).to_json()
    listed = {own["schedule"]["name"]} | {alt["schedule"]["name"] for alt in own["alternatives"]}
    assert any(name.startswith("zb") for name in listed), listed
    plan = search_plan(*job, top_k=3, pp=4, engine=engine).to_json()
    names = {plan["schedule"]["name"]} | {alt["schedule"]["name"] for alt in plan["alternatives"]}
    assert names <= runs, names
    with pytest.raises(MeshplanError, match=f"--schedule zbv: {engine} does not run it") as refusal:
        search_plan(*job, pp=4, engine=engine, schedule="zbv")
    assert "\n" not in str(refusal.value)


def test_a_torchtitan_plan_has_no_ulysses():
    """torchtitan's context parallelism is torch's ring attention: a plan for it never picks
    Ulysses (which meshplan's executor and Megatron-LM run), and pinning it is refused."""
    from meshplan.planner.contracts.errors import MeshplanError

    job = ("llama3-8b", "h100-sxm", 16, 64, 4096)
    plan = search_plan(*job, top_k=5, pp=4, cp=2, engine="torchtitan").to_json()
    methods = {plan.get("cp_method", "all-gather")} | {alt.get("cp_method", "all-gather") for alt in plan["alternatives"]}
    assert methods == {"all-gather"}
    with pytest.raises(MeshplanError, match="--cp-method ulysses: torchtitan does not run it"):
        search_plan(*job, pp=4, cp=2, engine="torchtitan", cp_method="ulysses")
