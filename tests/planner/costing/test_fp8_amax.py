"""torchao's amax all-reduces on torchtitan's TP shards (`costing.fp8_amax`), counted by hand on a
Llama 3 8B block at TP 8 (q, k, v, up, gate column Linears; o, down row Linears; two regions)."""
from __future__ import annotations

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import fp8_amax
from meshplan.planner.costing.collectives import all_reduce_time_s
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.profiling.profiler import profile

SEQ = 8192


def fp8_config(recipe: str, **kw) -> ParallelConfig:
    base = dict(gpus=8, global_batch=2, tp=8, pp=1, dp=1, microbatch_size=2, sp=True, engine="torchtitan",
                precision="fp8", fp8_recipe=recipe, recompute="selective")
    return ParallelConfig(**{**base, **kw})


def fsdp_config(recipe: str, **kw) -> ParallelConfig:
    """The same under FSDP2 (ZeRO-3 over 2 data ranks), which gathers tensorwise weights in fp8."""
    return fp8_config(recipe, gpus=16, dp=2, zero=3, global_batch=4, **kw)


def test_tensorwise_reduces_one_scalar_per_sharded_cast(llama, h100):
    """Forward: the two regions' inputs on their sequence shards and o's and down's inputs, 4
    scalars; backward: each of the 7 Linears' output gradients; the per-op policy reruns the
    forward's 4, full recomputation too, none without recomputation."""
    block, info = llama
    forward, backward = fp8_amax.reduction_bytes(block, info, fsdp_config("tensorwise"), "bf16")
    assert (forward, backward) == ((4.0,) * 4, (4.0,) * 7)
    one = all_reduce_time_s(4.0, 8, h100.link_for_group(8, 1))
    assert one > 0
    expected = (4 * one, 7 * one, 4 * one)
    assert fp8_amax.reduce_times_s(block, info, fsdp_config("tensorwise"), h100, "bf16") == pytest.approx(expected)
    full = fp8_amax.reduce_times_s(block, info, fsdp_config("tensorwise", recompute="full"), h100, "bf16")
    assert full == pytest.approx(expected)
    kept = fp8_amax.reduce_times_s(block, info, fsdp_config("tensorwise", recompute="none"), h100, "bf16")
    assert kept == pytest.approx((4 * one, 7 * one, 0.0))


def test_tensorwise_weights_reduce_where_fsdp_does_not_cast_them(llama):
    """TP alone (no float8 all-gather): each of the 7 Linears casts its TP-sharded weight in the
    forward, 7 scalars more; under FSDP2's float8 all-gather (ZeRO-3 over 2 data ranks) none."""
    block, info = llama
    alone, _ = fp8_amax.reduction_bytes(block, info, fp8_config("tensorwise"), "bf16")
    fsdp, _ = fp8_amax.reduction_bytes(block, info, fsdp_config("tensorwise"), "bf16")
    assert (len(alone), len(fsdp)) == (11, 4)


def test_rowwise_reduces_a_maximum_per_row_over_sharded_features(llama, h100):
    """2 x 8192 tokens. Forward: o's and down's inputs (a maximum a token) and weights (a maximum
    an output row, 4096 each); backward: q's, k's, v's, up's and gate's output gradients (a maximum
    a token) and weights for the input gradient (a maximum an input feature, 4096 each). 4 bytes
    a maximum."""
    block, info = llama
    tokens = 2 * SEQ
    forward, backward = fp8_amax.reduction_bytes(block, info, fp8_config("rowwise"), "bf16")
    assert sorted(forward) == sorted((4.0 * tokens, 4.0 * 4096) * 2)
    assert sorted(backward) == sorted((4.0 * tokens, 4.0 * 4096) * 5)
    link = h100.link_for_group(8, 1)
    fwd_s, bwd_s, rerun_s = fp8_amax.reduce_times_s(block, info, fp8_config("rowwise"), h100, "bf16")
    per_row_linear = all_reduce_time_s(4.0 * tokens, 8, link) + all_reduce_time_s(4.0 * 4096, 8, link)
    assert fwd_s == pytest.approx(2 * per_row_linear)
    assert bwd_s == pytest.approx(5 / 2 * fwd_s) and rerun_s == fwd_s


def test_only_torchtitans_dtensor_casts_reduce(llama, h100):
    """Megatron's Transformer Engine, delayed scaling, bf16, TP 1 and the embedding: none."""
    block, info = llama
    for config in (fp8_config("tensorwise", engine="megatron"), fp8_config("delayed", engine="megatron"),
                   fp8_config("tensorwise", tp=1, dp=8, sp=False, global_batch=16),
                   ParallelConfig(gpus=8, global_batch=2, tp=8, pp=1, dp=1, microbatch_size=2, sp=True,
                                  engine="torchtitan")):
        assert fp8_amax.reduce_times_s(block, info, config, h100, "bf16") == (0.0, 0.0, 0.0)
    graph = profile("llama3-8b", SEQ)
    embedding = next(layer for layer in graph.layers if layer.kind == "embedding")
    assert fp8_amax.reduce_times_s(embedding, info, fp8_config("tensorwise"), h100, "bf16") == (0.0, 0.0, 0.0)


def test_the_reductions_sit_on_the_compute_path(llama, h100, monkeypatch):
    """`layer_cost` adds them to the forward, backward and rerun it prices, so the ILP and the
    simulator wait on them alike."""
    block, info = llama
    config = fsdp_config("tensorwise")
    priced = layer_cost(block, config, h100, info)
    monkeypatch.setattr(fp8_amax, "reduce_times_s", lambda *args: (0.0, 0.0, 0.0))
    without = layer_cost(block, config, h100, info)
    fwd_s = 4 * all_reduce_time_s(4.0, 8, h100.link_for_group(8, 1))
    assert priced.fwd_compute_s - without.fwd_compute_s == pytest.approx(fwd_s)
    assert priced.bwd_compute_s - without.bwd_compute_s == pytest.approx(7 / 4 * fwd_s)
    assert priced.recompute_s - without.recompute_s == pytest.approx(fwd_s)
