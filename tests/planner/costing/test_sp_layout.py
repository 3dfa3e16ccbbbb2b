"""Batch-first sequence parallelism's layout copies (`costing.sp_layout`).

The rule is checked against torch: on the installed torch, re-concatenating a gathered
(tp * b, s / tp, h) tensor along the sequence, as `all_gather_single(gather_dim=1)` does after NCCL's
gather (`torch._utils._maybe_view_chunk_cat`), copies when b > 1 and is a view at b = 1, and
`_chunk_or_narrow_cat`, the rearrangement `reduce_scatter_single(scatter_dim=1)` makes of its
input, always copies. The bytes are held to a count by hand for a Llama 3 8B block at TP 4
(exact: whole tensors), and the time to what `layer_cost` charges the compute stream (1e-9
relative: the same sum)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._utils import _chunk_or_narrow_cat, _maybe_view_chunk_cat

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import sp_layout
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.profiling.profiler import profile

H100 = load_cluster("h100-sxm")
GRAPH = profile("llama3-8b", 4096, attention="sdpa-flash")
BLOCK = next(layer for layer in GRAPH.layers if layer.kind == "block")
TENSOR = BLOCK.output_bytes * 2  # the (2, 4096, 4096) bf16 residual stream of one micro-batch


def _config(**changes) -> ParallelConfig:
    base = dict(gpus=8, global_batch=4, dp=2, tp=4, sp=True, zero=3, microbatch_size=2, engine="torchtitan",
                recompute="none")
    return ParallelConfig(**{**base, **changes})


@pytest.mark.parametrize("batch, copies", [(1, False), (3, True)])
def test_torch_re_concatenates_a_sequence_gather_by_copy_unless_one_sequence(batch, copies):
    tp, shard_seq, hidden = 4, 8, 16
    gathered = torch.randn(tp * batch, shard_seq, hidden)  # NCCL's output: the ranks' (b, s/tp, h) shards on dim 0
    out = _maybe_view_chunk_cat(gathered, tp, 1)
    assert torch.equal(out, torch.cat(torch.chunk(gathered, tp, dim=0), dim=1))
    assert out.shape == (batch, tp * shard_seq, hidden)
    assert (out.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr()) is copies
    assert sp_layout.BATCH_FIRST_SP_ENGINES["meshplan"]  # the installed torch's view at one sequence
    stream = torch.randn(batch, tp * shard_seq, hidden)  # a reduce-scatter's input, scattered on the sequence
    regrouped = _chunk_or_narrow_cat(stream, tp, narrow_dim=1, cat_dim=0)
    assert regrouped.untyped_storage().data_ptr() != stream.untyped_storage().data_ptr()


def test_a_blocking_tp_block_copies_every_gather_and_scatter_both_ways():
    """Two regions a pass: forward 2 gathers + 2 scatters; backward 2 + 2, and under meshplan's
    executor, which keeps the sequence shards, their 2 regathers (torchtitan's Linears keep the
    gathered input: none); each copy reads and writes its tensor."""
    assert sp_layout.copy_bytes(BLOCK, _config(), 1.0) == (8 * TENSOR, 8 * TENSOR, 0.0)
    assert sp_layout.copy_bytes(BLOCK, _config(engine="meshplan"), 1.0) == (8 * TENSOR, 12 * TENSOR, 0.0)
    full = sp_layout.copy_bytes(BLOCK, _config(recompute="full"), 1.0)
    assert full == (8 * TENSOR, 8 * TENSOR, 8 * TENSOR)  # the rerun forward copies again
    sac = sp_layout.copy_bytes(BLOCK, _config(recompute="selective"), 1.0)
    assert sac == (8 * TENSOR, 8 * TENSOR, 4 * TENSOR)  # torchtitan's op policy reruns the gathers only


def test_float8_tp_gathers_copy_fp8_and_one_sequence_skips_the_gathers_cat_where_torch_views_it():
    fp8 = _config(precision="fp8", fp8_recipe="tensorwise")
    assert sp_layout.copy_bytes(BLOCK, fp8, 1.0) == (6 * TENSOR, 6 * TENSOR, 0.0)  # gathers at 1 byte a value
    one = TENSOR / 2
    assert sp_layout.copy_bytes(BLOCK, _config(engine="meshplan", microbatch_size=1, global_batch=2), 1.0) == \
        (4 * one, 4 * one, 0.0)  # the scatters' copies only
    assert sp_layout.copy_bytes(BLOCK, _config(microbatch_size=1, global_batch=2), 1.0) == \
        (8 * one, 8 * one, 0.0)  # torchtitan's torch 2.6-2.9 cats at every micro-batch


def test_async_tp_fuses_the_cats_away_but_its_gathered_tensors_are_copied_for_the_weight_gradients():
    """Llama's regions hold 3 and 2 column Linears, so no backward reduce-scatter fuses (2 copies);
    the forward's and the backward's 2 fused gathers each hand a sequence-major tensor to a weight
    gradient (4 copies)."""
    assert sp_layout.copy_bytes(BLOCK, _config(tp_comm_overlap=True), 1.0) == (0.0, 12 * TENSOR, 0.0)


def test_sequence_first_engines_and_measured_sp_overheads_are_not_charged():
    assert sp_layout.copy_times_s(BLOCK, _config(engine="megatron"), H100, 1.0) == (0.0, 0.0, 0.0)
    assert sp_layout.copy_times_s(BLOCK, _config(engine="meshplan", sp=False), H100, 1.0) == (0.0, 0.0, 0.0)
    measured = replace(H100, device=replace(H100.device, sp_layer_overhead_s=1e-3))
    assert sp_layout.copy_times_s(BLOCK, _config(engine="meshplan"), measured, 1.0) == (0.0, 0.0, 0.0)
    assert sp_layout.copy_times_s(BLOCK, _config(engine="meshplan"), H100, 1.0)[0] == \
        pytest.approx(memory_time_s(8 * TENSOR, H100), rel=1e-12)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_cost_charges_the_copies_to_the_compute_stream(recompute):
    """The same layer on a profile whose SP overhead is measured (a negligible 1e-15 s a pass, on the
    TP stream) differs by the copies in its forward, backward and rerun compute."""
    config = _config(recompute=recompute)
    measured = replace(H100, device=replace(H100.device, sp_layer_overhead_s=1e-15))
    cost = layer_cost(BLOCK, config, H100, GRAPH.info, profile_dtype=GRAPH.dtype, attention="sdpa-flash")
    without = layer_cost(BLOCK, config, measured, GRAPH.info, profile_dtype=GRAPH.dtype, attention="sdpa-flash")
    fwd, bwd, rerun = sp_layout.copy_times_s(BLOCK, config, H100, 1.0)
    assert fwd > 0 and bwd > 0
    assert cost.fwd_compute_s - without.fwd_compute_s == pytest.approx(fwd, rel=1e-9)
    assert cost.bwd_compute_s - without.bwd_compute_s == pytest.approx(bwd, rel=1e-9)
    assert cost.recompute_s - without.recompute_s == pytest.approx(rerun, abs=1e-15)


def test_what_the_backward_gathers_again_is_what_the_memory_no_longer_keeps(monkeypatch):
    """One rule (`engine_rules.GATHERED_INPUT_ENGINES`) for time and memory. torchtitan's Linears keep
    their gathered inputs, so without recomputation its backward gathers nothing again (backward
    gathers: the row Linears' output gradients, as many as forward's); were it to keep the sequence
    shards, as Megatron-LM and meshplan's executor do, it would save exactly the two gathered
    (2, 4096, 4096) bf16 inputs less and gather each again in backward (4 gathers). Exact: the same
    terms; 1e-12 relative for the sums of seconds."""
    from meshplan.planner.costing import communication, engine_memory
    from meshplan.planner.costing.communication import regathers, tp_comm_parts_s

    config = _config()
    assert not regathers(config) and not regathers(_config(recompute="full"))
    assert regathers(_config(engine="meshplan")) and regathers(_config(engine="megatron"))
    (gathers, _), (bwd_gathers, _) = tp_comm_parts_s(BLOCK, config, H100, 1.0)
    assert bwd_gathers == pytest.approx(gathers, rel=1e-12)

    def cost():
        return layer_cost(BLOCK, config, H100, GRAPH.info, profile_dtype=GRAPH.dtype, attention="sdpa-flash")

    kept = cost()
    monkeypatch.setattr(communication, "GATHERED_INPUT_ENGINES", ())
    monkeypatch.setattr(engine_memory, "GATHERED_INPUT_ENGINES", ())
    sharded = cost()
    assert kept.activation_bytes - sharded.activation_bytes == 2 * TENSOR
    (gathers, _), (bwd_gathers, _) = tp_comm_parts_s(BLOCK, config, H100, 1.0)
    assert bwd_gathers == pytest.approx(2 * gathers, rel=1e-12)
    assert sharded.tp_bwd_comm_s - kept.tp_bwd_comm_s == pytest.approx(gathers, rel=1e-12)
