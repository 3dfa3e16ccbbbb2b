"""What every prediction must keep, whatever the layout and whichever engine's memory and overlap it
assumes: the step-time breakdown adds up to the step, no memory part is negative, each rank's
total is the sum of its parts, the routed experts' states are a part of the model states (and are
exactly expert_params / (ep etp) per rank at the recipe's bytes per parameter when ZeRO shards
nothing), and `fits` says whether the peak is within the usable memory.

Hypothesis draws the layouts (tensor, pipeline, expert and expert-tensor degrees, ZeRO stage,
micro-batch, recomputation) for a small mixture of experts and a dense model on an H100 profile
under every engine; a layout an engine refuses is skipped (its one-line refusal is the bad-input
tests' business)."""
from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.engine_memory import engine_state_bytes
from meshplan.planner.simulation.estimator import estimate
from tests.bad_input_helpers import fast

MOE = "moe:layers=4,hidden=256,heads=8,kv_heads=4,experts=8,top_k=2,expert_ffn=512,vocab=2048"
DENSE = "llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn=768,vocab=2048"
GPUS, SEQ, CLUSTER = 16, 512, "h100-sxm"
# Routed-expert parameters of MOE: 4 blocks x 8 experts x 3 Linears (gate, up: h -> f; down: f -> h).
MOE_EXPERT_PARAMS = 4 * 8 * 3 * 256 * 512
ENGINES = ("meshplan", "megatron", "torchtitan", "deepspeed")


def _estimate(spec, engine, **layout):
    try:
        return estimate(spec, CLUSTER, gpus=GPUS, global_batch=32, seq=SEQ, engine=engine, **layout)
    except (MeshplanError, ValueError):
        assume(False)  # refused: not a layout this engine (or meshplan) runs


@fast(40)
@given(engine=st.sampled_from(ENGINES), moe=st.booleans(), tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]),
       ep=st.sampled_from([1, 2, 4, 8]), etp_one=st.booleans(), zero=st.integers(0, 3), mbs=st.sampled_from([1, 2]),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_every_prediction_adds_up(engine, moe, tp, pp, ep, etp_one, zero, mbs, recompute):
    layout = dict(tp=tp, pp=pp, zero=zero, mbs=mbs, recompute=recompute, sp=tp > 1 and engine != "deepspeed")
    if moe:
        layout.update(ep=ep, etp=1 if etp_one else None)
    prediction = _estimate(MOE if moe else DENSE, engine, **layout)
    assert sum(prediction.breakdown.values()) == pytest.approx(prediction.step_time_s, rel=1e-9)
    assert min(prediction.breakdown.values()) >= 0
    assert len(prediction.memory) == pp
    for rank in prediction.memory:
        parts = (rank.params, rank.grads, rank.optimizer, rank.activations, rank.buffers)
        assert min(parts) >= 0 and rank.total == pytest.approx(sum(parts), rel=1e-12)
        assert rank.experts <= (rank.params + rank.grads + rank.optimizer) * (1 + 1e-12)
        assert (rank.experts > 0) == moe  # every stage holds MoE blocks (4 blocks over at most 2 stages)
    assert prediction.peak_memory_bytes >= max(rank.total for rank in prediction.memory) * (1 - 1e-12)
    assert prediction.fits == (prediction.peak_memory_bytes <= _usable_bytes())


@pytest.mark.parametrize("engine", ["megatron", "torchtitan", "deepspeed"])
@pytest.mark.parametrize("tp, etp", [(2, 1), (4, 1), (2, 2)])
def test_expert_states_per_rank_follow_the_folding(engine, tp, etp):
    """ZeRO-0, one stage: each rank holds E / ep experts split etp ways, whatever the dense TP, at
    the engine's bytes per parameter (`engine_state_bytes`, nothing sharded)."""
    ep = 4
    prediction = _estimate(MOE, engine, tp=tp, pp=1, ep=ep, etp=etp, zero=0, mbs=1, recompute="none",
                           sp=engine != "deepspeed")
    expected = engine_state_bytes(engine, MOE_EXPERT_PARAMS / (ep * etp), GPUS * 1 // (ep * etp), 0, "bf16-mixed")
    assert prediction.memory[0].experts == pytest.approx(sum(expected.values()), rel=1e-12)


def _usable_bytes() -> float:
    from meshplan.planner.costing.hardware import load_cluster

    return load_cluster(CLUSTER).device.usable_memory_bytes
