"""Megatron-LM's bf16 gradient buffer (`ParallelConfig.grad_reduce_in_bf16`, --grad-reduce-in-bf16;
Megatron-Bridge's performance recipes' `ddp.grad_reduce_in_fp32 = False`): 2 bytes a parameter
instead of the fp32 `main_grad`'s 4, in the recipe, the estimate, plan.json and the Megatron-LM
export and import."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import plan_from_json
from meshplan.planner.costing.engine_memory import engine_state_bytes
from meshplan.planner.engines.bridge import export_plan, read_engine_text
from meshplan.planner.simulation.estimator import estimate
from tests.planner.engines.helpers import make_plan

SPEC = "gpt:layers=4,hidden=512,heads=8,vocab=8192"


@pytest.mark.parametrize("zero, expected", [(0, (2, 2, 12)), (1, (2, 2, 12 / 8)), (2, (2, 2 / 8, 12 / 8))])
def test_the_gradient_buffer_is_two_bytes_a_parameter(zero, expected):
    states = engine_state_bytes("megatron", 1.0, 8, zero, "bf16-mixed", 1, grad_reduce_in_bf16=True)
    assert (states["params"], states["grads"], states["optimizer"]) == pytest.approx(expected)


def test_the_estimate_halves_the_gradients_and_keeps_the_rest():
    kwargs = dict(gpus=2, global_batch=4, seq=256, mbs=2, zero=1, engine="megatron")
    fp32, bf16 = (estimate(SPEC, "a100-80g", grad_reduce_in_bf16=flag, **kwargs).memory[0] for flag in (False, True))
    assert bf16.grads == pytest.approx(fp32.grads / 2)
    assert (bf16.params, bf16.optimizer, bf16.activations) == pytest.approx((fp32.params, fp32.optimizer,
                                                                              fp32.activations))


def test_only_megatron_training_in_bf16_has_it():
    with pytest.raises(ValueError, match="engine megatron"):
        ParallelConfig(gpus=2, global_batch=2, dp=2, engine="torchtitan", grad_reduce_in_bf16=True)
    with pytest.raises(ValueError, match="precision bf16-mixed or fp8"):
        ParallelConfig(gpus=2, global_batch=2, dp=2, engine="megatron", precision="fp32", grad_reduce_in_bf16=True)
    with pytest.raises(MeshplanError, match="--grad-reduce-in-bf16"):
        estimate(SPEC, "a100-80g", gpus=2, global_batch=2, seq=128, grad_reduce_in_bf16=True)


def test_plan_json_and_the_megatron_arguments_carry_it():
    plan = make_plan(pp=2, dp=2, tp=2, zero=1)
    assert "grad_reduce_in_bf16" not in plan.to_json()  # plans without it keep their digest
    megatron = replace(plan, config=replace(plan.config, engine="megatron"))
    bf16 = replace(plan, config=replace(megatron.config, grad_reduce_in_bf16=True))
    assert plan_from_json(bf16.to_json()).config.grad_reduce_in_bf16
    assert bf16.config.label().endswith(", bf16 gradients") and "bf16" not in megatron.config.label()
    assert bf16.digest != megatron.digest
    text = export_plan(bf16, "megatron").text
    assert "--grad-reduce-in-bf16" in text and "--grad-reduce-in-bf16" not in export_plan(megatron, "megatron").text
    assert read_engine_text(text, "megatron").grad_reduce_in_bf16


def test_the_reduction_moves_half_the_bytes():
    """The gradient reduce-scatter runs over the bf16 buffer: on a bandwidth-bound link its time is
    the fp32 one's at half the bytes, worked through the same collective-time rule."""
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.costing.collectives import collective_time_s
    from meshplan.planner.costing.communication import dp_comm_s

    cluster = load_cluster("h100-sxm")
    params = 4e9
    for zero, reduce in ((0, "all_reduce"), (1, "reduce_scatter")):
        fp32, bf16 = (ParallelConfig(gpus=16, global_batch=16, dp=16, zero=zero, engine="megatron",
                                     grad_reduce_in_bf16=flag) for flag in (False, True))
        assert dp_comm_s(params, fp32, cluster)[0] == pytest.approx(collective_time_s(reduce, params * 4, 16, cluster, 1))
        assert dp_comm_s(params, bf16, cluster)[0] == pytest.approx(collective_time_s(reduce, params * 2, 16, cluster, 1))


def test_the_estimate_reduces_faster_with_bf16_gradients():
    kwargs = dict(gpus=16, global_batch=16, seq=256, zero=1, engine="megatron")
    fp32, bf16 = (estimate(SPEC, "h100-sxm", grad_reduce_in_bf16=flag, **kwargs) for flag in (False, True))
    assert bf16.step_time_s < fp32.step_time_s


def test_megatron_reduces_and_gathers_a_layer_as_its_share_of_a_bucket():
    """Megatron-Core's DDP buckets hold max(40M, 1M x dp) parameters: a layer of 30M parameters a rank
    at dp 256 pays 30/256 of the 256M-parameter bucket's collectives (one ring latency a bucket, not
    one a layer); at dp 16 its share of a 40M bucket; a layer larger than a bucket pays its own; other
    engines, and Megatron FSDP (ZeRO-3), price the layer's own collective."""
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.costing.collectives import collective_time_s
    from meshplan.planner.costing.communication import dp_comm_s, megatron_bucket_scale

    cluster = load_cluster("h100-sxm")
    params = 30e6
    for dp, bucket in ((256, 256e6), (16, 40e6)):
        config = ParallelConfig(gpus=dp, global_batch=dp, dp=dp, zero=1, engine="megatron", grad_reduce_in_bf16=True)
        assert megatron_bucket_scale(params, config) == pytest.approx(bucket / params)
        expected = collective_time_s("reduce_scatter", bucket * 2, dp, cluster, 1) * params / bucket
        assert dp_comm_s(params, config, cluster)[0] == pytest.approx(expected, rel=1e-12)
        assert expected < collective_time_s("reduce_scatter", params * 2, dp, cluster, 1)
        assert megatron_bucket_scale(bucket * 2, config) == 1.0
    for other in (ParallelConfig(gpus=256, global_batch=256, dp=256, zero=1, engine="torchtitan"),
                  ParallelConfig(gpus=256, global_batch=256, dp=256, zero=3, engine="megatron")):
        assert megatron_bucket_scale(params, other) == 1.0
