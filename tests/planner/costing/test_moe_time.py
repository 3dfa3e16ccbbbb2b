"""The MoE time model (planner.costing.moe_compute, expert_parallel): rows per expert, grouped
GEMMs by shape at those rows, the token shuffles, capacity dropping and padding, the all-to-all's
group inside and across nodes, and the all-to-all overlap share; each against its formula."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import expert_parallel as epm
from meshplan.planner.costing import gemm, moe_compute
from meshplan.planner.costing.collectives import collective_time_s, group_placement
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from tests.planner.costing.meshes import (EXPERT_FFN, EXPERTS, HIDDEN, SEQ, SMALL_MOE, TOP_K, expert_block,
                                          expert_block_cost, mesh, small_moe_graph)

H100 = load_cluster("h100-sxm")
WIDTH = EXPERT_FFN


@pytest.fixture(scope="module")
def graph():
    return small_moe_graph()


_block, _cost = expert_block, expert_block_cost


@pytest.mark.parametrize("tp,etp,ep,mbs,rows", [
    (1, 1, 4, 2, 1024 * 2 * 2 * 4 / 16),   # T k ep / E: 2048 tokens x 2 copies over 4 of 16 experts' ranks
    (2, 1, 4, 2, 512.0),                   # tp 2 shares the copies, etp 1: 2048 * 2 / 2 over 4 local experts
    (2, 2, 2, 2, 512.0),                   # etp = tp: each of 8 local expert shards takes 2048 * 2 / 2 * 2 / 8
])
def test_rows_per_expert_are_tokens_times_top_k_times_etp_ep_over_tp_experts(graph, tp, etp, ep, mbs, rows):
    config = mesh(tp=tp, dp=8, ep=ep, microbatch_size=mbs, etp=etp)
    assert moe_compute.routed_copies(_block(graph), graph.info) == SEQ * TOP_K
    expected = SEQ * mbs * TOP_K * etp * ep / (tp * EXPERTS)
    assert expected == rows
    assert moe_compute.tokens_per_expert(_block(graph), config, graph.info, 1.0) == pytest.approx(rows, rel=1e-12)
    assert moe_compute.tokens_per_expert(_block(graph), config, graph.info, 1.5) == pytest.approx(1.5 * rows, rel=1e-12)


def test_expert_shapes_are_the_swiglu_of_the_expert_width(graph):
    assert moe_compute.expert_linear_shapes(_block(graph), graph.info) == (
        (HIDDEN, WIDTH, True), (HIDDEN, WIDTH, True), (WIDTH, HIDDEN, False))
    # a model that names no expert width keeps the FLOP curve
    assert moe_compute.expert_linear_shapes(_block(graph), replace(graph.info, expert_ffn=0)) == ()


def _gemm_s(m: int, n: int, k: int, wave: float) -> float:
    """One bf16 GEMM on H100 by hand: FLOPs at peak x matmul_efficiency x size curve x wave
    efficiency, or its A, B, C bytes at the achieved bandwidth, whichever is longer."""
    device = H100.device
    flops = 2.0 * m * n * k
    rate = device.peak_flops("bf16") * device.matmul_efficiency * flops / (
        flops + device.matmul_half_efficiency_flops) * wave
    memory_s = 2.0 * (m * k + k * n + m * n) / (device.memory_bw_bytes_per_s * device.memory_efficiency)
    return max(flops / rate, memory_s)


def test_grouped_gemm_time_is_the_experts_wave_quantised_gemms(graph):
    """ep 4 of 16 experts at mbs 1: G = 4 experts of m = 1024 * 2 * 4 / 16 = 512 rows. Every shape
    here (512 x 256 out of 512 in, 512 x 512 out of 256 in, the weight gradients 512 x 256 and
    256 x 512 over 512 rows) fills its tiles and runs fewer tiles than H100's 132 SMs: wave
    efficiency 1."""
    config = mesh(dp=8, ep=4)
    rows = 512
    assert moe_compute.tokens_per_expert(_block(graph), config, graph.info, 1.0) == rows
    for m, n in ((512, 256), (512, 512), (256, 512)):
        assert gemm.wave_efficiency(m, n, H100.device.num_sms) == 1.0
    fwd_one = 2 * _gemm_s(rows, WIDTH, HIDDEN, 1.0) + _gemm_s(rows, HIDDEN, WIDTH, 1.0)
    bwd_one = (2 * (_gemm_s(rows, HIDDEN, WIDTH, 1.0) + _gemm_s(HIDDEN, WIDTH, rows, 1.0))
               + _gemm_s(rows, WIDTH, HIDDEN, 1.0) + _gemm_s(WIDTH, HIDDEN, rows, 1.0))
    overhead = H100.device.kernel_overhead_s
    tail = 3 * 3 * moe_compute.grouped_gemm_tail_s()  # 3 grouped calls forward, 3 extra groups each
    fwd_s, bwd_s = moe_compute.grouped_gemm_times_s(_block(graph), config, H100, graph.info, "bf16", 1.0)
    assert fwd_s == pytest.approx(4 * fwd_one + tail + overhead, rel=1e-9)
    assert bwd_s == pytest.approx(4 * bwd_one + 2 * tail + 2 * overhead, rel=1e-9)
    # one expert per rank (ep = E): no extra group, no tail
    single = mesh(dp=16, ep=16)
    rows16 = moe_compute.tokens_per_expert(_block(graph), single, graph.info, 1.0)
    fwd16, _ = moe_compute.grouped_gemm_times_s(_block(graph), single, H100, graph.info, "bf16", 1.0)
    assert fwd16 == pytest.approx(sum(gemm.gemm_time_s(rows16, o, i, H100, "bf16")
                                      for i, o, _ in moe_compute.expert_linear_shapes(_block(graph), graph.info))
                                  + overhead, rel=1e-9)


def test_grouped_gemm_tail_is_the_published_kernels_excess_per_extra_group():
    """The tail is what DeepGEMM's masked grouped kernel takes beyond the shape rule's G GEMMs
    (fp8 on h100-sxm, H800's compute), less the one-group row's own excess, pooled over the 8
    extra groups of the table: worked here from the two published row pairs per width, 2.0 us
    on the shipped profile (the figure the module docstring states)."""
    def excess_s(groups, rows, n, k, tflops):
        return 2 * groups * rows * n * k / (tflops * 1e12) - groups * gemm.gemm_time_s(rows, n, k, H100, "fp8")
    table = moe_compute.DEEPGEMM_MASKED
    pooled = [excess_s(*table[i]) - excess_s(*table[base]) for base in (0, 3) for i in (base + 1, base + 2)]
    assert sum(row[0] - 1 for row in table) == 8
    assert moe_compute.grouped_gemm_tail_s() == pytest.approx(sum(pooled) / 8, rel=1e-12)
    assert moe_compute.grouped_gemm_tail_s() == pytest.approx(2.03e-6, abs=0.05e-6)
    assert all(extra > 0 for extra in pooled)  # every split runs slower than its shapes: a tail, not noise


def test_a_partial_tail_wave_costs_a_full_one():
    """m = 1000 rows of a 1536-wide product: the best tile (128 x 256: 8 x 6 = 48 tiles, under
    132 SMs) pads 1000 rows to 1024: useful share 1000 / 1024."""
    assert gemm.wave_efficiency(1000, 1536, 132) == pytest.approx(1000 / 1024, rel=1e-12)
    # 265 tiles of 128 x 128 run in 3 waves of 132 SMs, the last one 1 tile: useful 265 / 396
    assert gemm.wave_efficiency(128 * 265, 128, 132) == pytest.approx(265 / 396, rel=1e-12)


def test_expert_time_is_grouped_gemms_plus_saved_traffic_plus_shuffles(graph):
    config = mesh(dp=8, ep=4, microbatch_size=2)
    block, info = _block(graph), graph.info
    cost = _cost(graph, dp=8, ep=4, microbatch_size=2)
    fwd_gemm_s, bwd_gemm_s = moe_compute.grouped_gemm_times_s(block, config, H100, info, "bf16", 1.0)
    device = H100.device
    bandwidth = device.memory_bw_bytes_per_s * device.memory_efficiency
    saved = block.expert_act_bytes * 2
    rows = 1024 * 2 * 2 * 4 / 16  # m: 1024 rows per expert, 4 local experts
    shuffle_bytes = 4 * rows * 4 * HIDDEN * 2
    assert moe_compute.shuffle_bytes(block, config, info, 1.0, 2) == shuffle_bytes
    traffic = device.elementwise_bytes_per_activation_byte * saved
    assert cost.expert_fwd_s == pytest.approx(fwd_gemm_s + traffic / bandwidth + shuffle_bytes / bandwidth, rel=1e-9)
    assert cost.expert_bwd_s == pytest.approx(bwd_gemm_s + 2 * traffic / bandwidth + shuffle_bytes / bandwidth,
                                              rel=1e-9)


def test_small_per_expert_batches_run_below_the_large_ones_rate(graph):
    """The same expert FLOPs on 16 experts of 128 rows (ep 1) take longer than on 2 experts of
    1024 rows (ep 8): the fixed per-GEMM cost and the roofline weigh on small products."""
    slow, fast = _cost(graph, dp=8, ep=1), _cost(graph, dp=8, ep=8)
    assert slow.expert_fwd_s > 1.5 * fast.expert_fwd_s


def test_dropped_tokens_cost_nothing_and_padded_slots_cost_compute(graph):
    info = graph.info
    kwargs = dict(dp=8, ep=4, microbatch_size=2)
    # F = 2 routed to the busiest expert, capacity 1.25: it computes 1.25 x the balanced rows
    dropping = _cost(graph, info=replace(info, moe_imbalance=2.0, moe_capacity_factor=1.25), **kwargs)
    as_capacity = _cost(graph, info=replace(info, moe_imbalance=1.25), **kwargs)
    assert dropping.expert_fwd_s == pytest.approx(as_capacity.expert_fwd_s, rel=1e-12)
    assert dropping.ep_fwd_comm_s == pytest.approx(as_capacity.ep_fwd_comm_s, rel=1e-12)
    # balanced routing padded to capacity 1.5: every expert runs 1.5 x the balanced rows
    padded = _cost(graph, info=replace(info, moe_capacity_factor=1.5, moe_pad_to_capacity=True), **kwargs)
    assert padded.expert_fwd_s == pytest.approx(_cost(graph, info=replace(info, moe_imbalance=1.5),
                                                      **kwargs).expert_fwd_s, rel=1e-12)
    assert padded.expert_fwd_s > _cost(graph, **kwargs).expert_fwd_s
    config = mesh(**kwargs)
    assert moe_compute.tokens_per_expert(_block(graph), config, info, epm.load_factor(
        replace(info, moe_imbalance=2.0, moe_capacity_factor=1.25))) == pytest.approx(1.25 * 1024, rel=1e-12)


def test_all_to_all_group_inside_a_node_and_across_the_rails(graph):
    """ep 8 ranks etp apart: etp 1 keeps the group in one node of 8 (NVLink); etp 2 spreads it
    over two nodes, whose all-to-all crosses the rails and costs more for the same bytes."""
    send = 4096.0 * 1024 * 8
    inside, across = group_placement(8, 1, 8), group_placement(8, 2, 8)
    assert (inside.num_nodes, across.num_nodes) == (1, 2)
    one_node = epm.all_to_all_s(send, mesh(tp=2, dp=8, ep=8, etp=1), H100, graph.info)
    two_nodes = epm.all_to_all_s(send, mesh(tp=2, dp=8, ep=8, etp=2), H100, graph.info)
    assert one_node == collective_time_s("all_to_all", send, 8, H100, 1)
    assert two_nodes == collective_time_s("all_to_all", send, 8, H100, 2)
    assert two_nodes > 2 * one_node


def test_all_to_all_overlap_share_hides_that_share_of_dispatch_and_combine(graph):
    config, send = mesh(dp=16, ep=8, microbatch_size=2), 2 * SEQ * TOP_K * HIDDEN * 2
    one = collective_time_s("all_to_all", send, 8, H100, 1)
    assert epm.ep_comm_s(send, config, H100, graph.info) == pytest.approx((2 * one, 2 * one), rel=1e-12)
    assert epm.ep_comm_s(send, config, H100, graph.info, a2a_overlap=0.25) == pytest.approx(
        (1.5 * one, 1.5 * one), rel=1e-12)
    assert epm.ep_comm_s(send, config, H100, graph.info, a2a_overlap=1.0) == (0.0, 0.0)
    with pytest.raises(ValueError, match=r"\[0, 1\], got 1.5"):
        epm.ep_comm_s(send, config, H100, graph.info, a2a_overlap=1.5)


def test_router_gate_is_priced_by_its_shape_on_the_ranks_tokens(graph):
    """The gate Linear (h -> E) on the rank's tokens: all T of a micro-batch without SP (every tp
    rank routes them), T / tp under SP; its FLOPs leave the dense part, which no longer prices them."""
    block, info = _block(graph), graph.info
    assert moe_compute.router_flops(block, info) == 2 * SEQ * HIDDEN * EXPERTS
    dense = epm.dense_part(block, info)
    assert dense.fwd_flops == block.fwd_flops - block.expert_fwd_flops - 2 * SEQ * HIDDEN * EXPERTS
    assert dense.bwd_flops == block.bwd_flops - block.expert_bwd_flops - 4 * SEQ * HIDDEN * EXPERTS
    assert epm.dense_part(block).fwd_flops == block.fwd_flops - block.expert_fwd_flops  # without info: kept
    shape = ((HIDDEN, EXPERTS, True),)
    for sp, tokens in ((False, 2 * SEQ), (True, SEQ)):
        config = mesh(tp=2, dp=4, ep=4, microbatch_size=2, sp=sp)
        fwd_s, bwd_s = moe_compute.router_times_s(block, config, H100, info, "bf16")
        assert (fwd_s, bwd_s) == gemm.linear_times_s(shape, tokens, 1, H100, "bf16")
        # forward (T x 512) @ (512 x 16): 16-wide tiles fill every SM's tile (wave efficiency 1)
        assert gemm.wave_efficiency(tokens, EXPERTS, H100.device.num_sms) == 1.0
        assert fwd_s == pytest.approx(_gemm_s(tokens, EXPERTS, HIDDEN, 1.0), rel=1e-9)
    # the router is the block's, not the experts': in fwd_compute_s, not in expert_fwd_s
    config = mesh(dp=8, ep=4)
    cost = _cost(graph, dp=8, ep=4)
    dense_cost = layer_cost(dense, config, H100, info, profile_dtype="bf16")
    router_fwd_s, _ = moe_compute.router_times_s(block, config, H100, info, "bf16")
    assert cost.fwd_compute_s - cost.expert_fwd_s == pytest.approx(dense_cost.fwd_compute_s + router_fwd_s, rel=1e-9)


def test_with_routed_experts_passes_the_overlap_share_to_the_all_to_alls(graph):
    """Where an engine's overlap data plugs in: `with_routed_experts(..., a2a_overlap=)`."""
    block, info, config = _block(graph), graph.info, mesh(dp=16, ep=8, microbatch_size=2)
    dense = layer_cost(epm.dense_part(block, info), config, H100, info, profile_dtype="bf16")
    send = epm.dispatch_send_bytes(block, config, 1.0)
    for share in (0.0, 0.6):
        cost = epm.with_routed_experts(dense, block, config, H100, info, "bf16", a2a_overlap=share)
        assert (cost.ep_fwd_comm_s, cost.ep_bwd_comm_s) == pytest.approx(
            epm.ep_comm_s(send, config, H100, info, a2a_overlap=share), rel=1e-12)
    assert _cost(graph, dp=16, ep=8, microbatch_size=2).ep_fwd_comm_s == pytest.approx(
        epm.ep_comm_s(send, config, H100, info)[0], rel=1e-12)


def test_the_dense_parts_linears_are_priced_by_shape_as_a_dense_blocks():
    """A MoE block's dense part: attention's q, k, v, o and the shared experts' SwiGLU by shape
    (`gemm.block_linear_shapes`), the same rule as a dense block's; a dense-first block keeps its MLP."""
    from meshplan.planner.costing.device_time import infer_seq
    from meshplan.planner.profiling.profiler import profile

    shared = profile(SMALL_MOE + ",shared_experts=1,dense_layers=1,ffn=1024", SEQ, dtype="bf16")
    info = shared.info
    dense_first, moe = shared.layers[1], shared.layers[2]
    assert not dense_first.expert_params and moe.expert_params
    kv = info.num_kv_heads * (info.head_dim or HIDDEN // info.num_heads)
    attention = ((HIDDEN, HIDDEN, True), (HIDDEN, kv, True), (HIDDEN, kv, True), (HIDDEN, HIDDEN, False))
    part = epm.dense_part(moe, info)
    assert gemm.block_linear_shapes(part, info, infer_seq(part, info, "bf16")) == attention + (
        (HIDDEN, info.shared_ffn, True), (HIDDEN, info.shared_ffn, True), (info.shared_ffn, HIDDEN, False))
    assert gemm.block_linear_shapes(dense_first, info, SEQ) == attention + (
        (HIDDEN, 1024, True), (HIDDEN, 1024, True), (1024, HIDDEN, False))
    # the whole MoE block (routed experts included) is not a dense block's shapes
    assert gemm.block_linear_shapes(moe, info, SEQ) == ()


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_megatron_runs_the_experts_in_fp8_with_their_casts(graph, recipe):
    """Under --engine megatron and fp8 the rank's G experts run their grouped GEMMs at the fp8 rate
    by shape and pay the recipe's casts: per expert its fc1 input (m x h, once for gate and up), its
    down projection's input (m x f), its output gradients (m x 2f and m x h), and its weights
    (3 h f) once per step of `num_microbatches`; under torchtitan (whose Float8 converts nn.Linear
    only) and bf16 the experts keep the bf16 grouped GEMMs."""
    from meshplan.planner.costing import fp8
    from meshplan.planner.costing.device_time import memory_time_s

    gpus, m = 8, 4
    config = ParallelConfig(gpus=gpus, global_batch=gpus * m, dp=gpus, ep=4, precision="fp8",
                            fp8_recipe=recipe, engine="megatron")
    block, groups, rows = _block(graph), EXPERTS // 4, 1024 * 2 * 4 / 16
    assert config.num_microbatches == m and moe_compute.tokens_per_expert(block, config, graph.info, 1.0) == rows
    chosen = fp8.RECIPES[recipe]
    inputs = groups * rows * (HIDDEN + WIDTH)
    grads = groups * rows * (2 * WIDTH + HIDDEN)
    weights = groups * 3 * HIDDEN * WIDTH
    cast_fwd = memory_time_s(inputs * chosen.activation_cast_bytes + weights / m * chosen.weight_cast_bytes, H100)
    cast_bwd = memory_time_s(grads * chosen.activation_cast_bytes, H100)
    gemm_fwd, gemm_bwd = moe_compute.grouped_gemm_times_s(block, config, H100, graph.info, "fp8", 1.0)
    assert epm.expert_compute_s(block, config, H100, graph.info, "bf16", 1.0) == pytest.approx(
        (gemm_fwd + cast_fwd, gemm_bwd + cast_bwd), rel=1e-12)
    bf16 = moe_compute.grouped_gemm_times_s(block, config, H100, graph.info, "bf16", 1.0)
    for other in (replace(config, engine="torchtitan", fp8_recipe="tensorwise"),
                  replace(config, precision="bf16-mixed", fp8_recipe=None)):
        assert epm.expert_compute_s(block, other, H100, graph.info, "bf16", 1.0) == pytest.approx(bf16, rel=1e-12)
