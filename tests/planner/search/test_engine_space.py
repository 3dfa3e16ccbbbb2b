"""The search space follows the engine that runs the plan: under `--engine megatron` a traced
mixture of experts (DeepSeek-V2-Lite) gets expert parallelism, which meshplan's own executor does
not run for such models, and the unpinned search is no slower than the search pinned to any EP
degree, as a search over a superset must be (up to the ILPs' relative gap, 0.5% here, the
tolerance HiGHS's MIP gap and the re-ranking's rounding leave)."""
from __future__ import annotations

import pytest

from meshplan.planner.search.driver import search_plan

# 16 GPUs, where an EP degree wins; on 64, data parallelism alone is the faster plan (the
# all-to-alls carry top_k copies of every token).
JOB = dict(spec="deepseek-v2-lite", cluster="h100-sxm", gpus=16, global_batch=256, seq=4096)


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
    for ep in (2, 8, 16):
        pinned = _plan(engine="megatron", ep=ep).to_json()
        assert step_s <= pinned["prediction"]["step_time_s"] * 1.005, ep


def test_the_default_engine_keeps_to_the_executor_and_says_what_it_left_out():
    pytest.importorskip("transformers")
    own = _plan().to_json()
    assert own["mesh"].get("ep", 1) == 1 and own["mesh"]["tp"] == 1
    assert own["solver"]["num_executor_limited"] > 0
