"""Eager blocks (torchtitan's Llama, meshplan's executor, llm-foundry's MPT): their elementwise kernels' bytes,
counted op by op (`profiling.eager_traffic`), against a count by hand, and what `compute_times_s` charges for them."""
from __future__ import annotations

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import eager_kernels
from meshplan.planner.costing.activation_memory import activation_bytes, rebuilt_bytes
from meshplan.planner.costing.compute_time import compute_times_s
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling import eager_traffic
from meshplan.planner.profiling.profiler import profile

SEQ = 2048


def _forward_by_hand(h: int, heads: int, kv_heads: int, head_dim: int, f: int, tokens: int) -> float:
    """Bytes per token of the forward's kernels, op by op (bf16 activations, fp32 in the norm and
    rotary embedding). Each RMSNorm: x.float() 2h read + 4h written, pow 4h + 4h, mean 4h + 4,
    + eps 4 + 4, rsqrt 4 + 4, y * rsqrt 4h + 4 + 4h, type_as 4h + 2h, * weight 2h + 2h (and the
    weight's 2h bytes once for all tokens). Rotary: q and k to fp32 (6 bytes a value), a complex
    multiply each (4 read, 4 written, and the frequencies' 8 bytes per pair of head_dim once per
    token), back to bf16 (6). repeat_kv's copies: k's and v's storage read, the query heads' width
    written. Two residual adds 6h each; SwiGLU: silu 4f, the product 6f."""
    q, kv = heads * head_dim, kv_heads * head_dim
    norm = 36 * h + 24 + 2 * h / tokens
    rotary = 20 * q + 20 * kv + 2 * 4 * head_dim
    repeat = 2 * (2 * kv + 2 * q) if heads != kv_heads else 0
    return 2 * norm + rotary + repeat + 2 * 6 * h + 10 * f


def _norm_backward_by_hand(h: int, tokens: int) -> float:
    """One RMSNorm's backward kernels per token, as autograd runs them: grad x weight (2h read, the
    weight once, 2h written), grad x normed (6h) summed over tokens for the weight's gradient (2h
    read), the bf16 -> fp32 cast (6h), the fp32 product rule through y * rsqrt (12h, then 8h + 4 with
    the per-token rsqrt broadcast, its sum over h 4h + 4, three per-token ops 28), mean's backward
    (4h + 4), pow's (8h, 8h), the two paths into y added (12h + 12h), back to bf16 (6h)."""
    return 92 * h + 40 + 4 * h / tokens


def _backward_by_hand(h: int, heads: int, kv_heads: int, head_dim: int, f: int, tokens: int) -> float:
    """Bytes per token of the backward's kernels: SwiGLU's product (two multiplies, 12f) and
    silu's backward (6f); five residual-stream adds of bf16 gradients (6h each: up + gate into the
    norm output, q + k + v into theirs (two), and each residual branch into the block's input and
    middle); the two norms; repeat_kv's sums back to the K/V heads; the rotary embedding's
    (bf16 -> fp32 cast 6, complex multiply by the frequencies' conjugate 8 and back 6 a value, the
    frequencies read 4 x head_dim, conjugated and cloned 16 x head_dim, for q and for k)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    repeat = 2 * (2 * q + 2 * kv) if heads != kv_heads else 0
    rotary = 20 * q + 20 * kv + 2 * (4 + 16) * head_dim
    return 18 * f + 5 * 6 * h + 2 * _norm_backward_by_hand(h, tokens) + repeat + rotary


@pytest.mark.parametrize("shape", [(4096, 32, 8, 128, 14336), (5120, 40, 40, 128, 13824), (1024, 8, 2, 128, 2816)])
def test_the_forward_count_is_the_blocks_ops_by_hand(shape):
    """Llama 3 8B, Llama 2 13B (no GQA: no repeat_kv copies) and a small GQA block, exactly, the
    backward too."""
    forward, backward = eager_traffic.block_bytes(*shape)
    assert forward == pytest.approx(_forward_by_hand(*shape, eager_traffic.TOKENS), rel=1e-12)
    assert backward == pytest.approx(_backward_by_hand(*shape, eager_traffic.TOKENS), rel=1e-12)
    # autograd's kernels: each op's backward reads its saved inputs and the incoming gradient and
    # writes the outgoing one, more than the forward and less than three times it
    assert 1.8 * forward < backward < 3 * forward


@pytest.mark.parametrize("shape", [(4096, 32, 8, 128, 14336), (5120, 40, 40, 128, 13824), (1024, 8, 2, 128, 2816),
                                   (392, 6, 3, 64, 1000)])
def test_the_torchtitan_count_is_its_closed_form(shape):
    """What the cost model prices without torch (`eager_kernels.torchtitan_bytes_per_token`) is the
    trace's per-token count exactly, the norms' weight-sized terms (read once for all tokens) set
    apart by two token counts' difference."""
    h, heads, kv, d, f = shape
    (f64, b64), (f128, b128) = (eager_traffic.block_bytes(*shape, tokens=t) for t in (64, 128))
    traced = ((128 * f128 - 64 * f64) / 64, (128 * b128 - 64 * b64) / 64)
    info = _info("llama", h, heads, kv, f, d)
    assert eager_kernels.torchtitan_bytes_per_token(info, f) == pytest.approx(traced, rel=1e-12)


def test_the_count_exceeds_the_fused_rule_for_llama_3_8b():
    """Per token and hidden unit: 149 forward and 308 backward, where the fitted rule charges
    Megatron's fused kernels' 87 and 173 (the README's figures)."""
    forward, backward = eager_traffic.block_bytes(4096, 32, 8, 128, 14336)
    assert forward / 4096 == pytest.approx(149.3, abs=0.1) and backward / 4096 == pytest.approx(308.4, abs=0.1)


def _config(**changes) -> ParallelConfig:
    base = dict(gpus=8, global_batch=16, tp=2, sp=True, dp=4, microbatch_size=2, zero=3, engine="torchtitan")
    return ParallelConfig(**{**base, **changes})


def test_torchtitan_eager_blocks_pay_the_counted_bytes_compiled_ones_the_rule():
    """A Llama 3 8B block at micro-batch 2 over TP 2: eager, its counted bytes per token times the
    rank's 2 x 2048 / 2 tokens at the achieved bandwidth replace the rule's; compiled, and under
    any other engine, the rule stands; the GEMMs are the same either way."""
    graph = profile("llama3-8b", SEQ)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    cluster = load_cluster("h100-sxm")
    eager, compiled = _config(), _config(torch_compile=True)
    assert eager_kernels.counts_eager_kernels(block, eager, graph.info, "bf16")
    assert not eager_kernels.counts_eager_kernels(block, compiled, graph.info, "bf16")
    # torchtitan's async TP runs only compiled (its parallelize refuses it otherwise)
    assert not eager_kernels.counts_eager_kernels(block, _config(tp_comm_overlap=True), graph.info, "bf16")
    assert not eager_kernels.counts_eager_kernels(block, _config(engine="megatron"), graph.info, "bf16")
    head = next(layer for layer in graph.layers if layer.kind == "head")
    assert not eager_kernels.counts_eager_kernels(head, eager, graph.info, "bf16")
    forward, backward = eager_kernels.torchtitan_bytes_per_token(graph.info, 14336)
    tokens = 2 * SEQ / 2
    assert eager_kernels.eager_bytes(block, eager, graph.info, "bf16") == pytest.approx((forward * tokens,
                                                                                         backward * tokens))
    eager_fwd, eager_bwd, _ = compute_times_s(block, eager, cluster, graph.info, 1.0, 1.0, "bf16", graph.attention)
    fused_fwd, fused_bwd, _ = compute_times_s(block, compiled, cluster, graph.info, 1.0, 1.0, "bf16", graph.attention)
    # the rule's bytes: the profile's factor times what the block saves (its rebuilt norm outputs
    # counted in, and written once more in backward without recomputation)
    rebuilt = rebuilt_bytes(block, compiled, 1.0)
    saved = activation_bytes(block, compiled, 1.0, recompute="none")[0] + rebuilt
    rule = cluster.device.elementwise_bytes_per_activation_byte
    assert eager_fwd - fused_fwd == pytest.approx(memory_time_s(forward * tokens, cluster)
                                                  - memory_time_s(rule * saved, cluster), rel=1e-9)
    assert eager_bwd - fused_bwd == pytest.approx(memory_time_s(backward * tokens, cluster)
                                                  - memory_time_s(rule * (2 * saved + rebuilt), cluster), rel=1e-9)
    assert eager_fwd > fused_fwd and eager_bwd > fused_bwd


# meshplan's own executor block (`models.transformer.Block`): the closed form the cost model prices
# (`eager_kernels.executor_bytes_per_token`, no torch) against the block's code traced on meta.

def _traced_per_token(family, h, heads, kv, f, d, qk_norm=False, qkv_bias=False):
    """Per token, without the weight-sized terms: two token counts' difference."""
    small = eager_traffic.executor_block_bytes(family, h, heads, kv, f, d, qk_norm, qkv_bias, tokens=64)
    large = eager_traffic.executor_block_bytes(family, h, heads, kv, f, d, qk_norm, qkv_bias, tokens=128)
    return tuple((b - a) / 64 for a, b in zip(small, large))


def _info(family, h, heads, kv, f, d):
    from meshplan.planner.contracts.graph import ModelInfo

    return ModelInfo(family=family, hidden=h, num_heads=heads, num_kv_heads=kv, ffn=f,
                     head_dim=d if family != "gpt" else 0)


@pytest.mark.parametrize("qk_norm, qkv_bias", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("shape", [(296, 4, 2, 664, 48), (520, 12, 4, 176, 64), (392, 6, 3, 1000, 96),
                                   (4096, 32, 8, 14336, 128)])
def test_the_executor_llama_count_is_its_closed_form(shape, qk_norm, qkv_bias):
    """Exactly, forward and backward, their residual-stream shares too, for the base block, Qwen's
    q/k norms and biases, at shapes whose widths differ from the hidden size (the tracer tells the
    stream share by width), and at Llama 3 8B's, whose query width is the hidden size: there the
    totals (a q bias's gradient sum reads as the stream's to the tracer)."""
    traced = _traced_per_token("llama", *shape, qk_norm, qkv_bias)
    closed = eager_kernels.executor_bytes_per_token(_info("llama", *shape), shape[3], qk_norm, qkv_bias)
    h, heads, _, _, d = shape
    checked = (0, 2) if heads * d == h else (0, 1, 2, 3)
    assert [closed[i] for i in checked] == pytest.approx([traced[i] for i in checked], rel=1e-12, abs=1e-9)


def test_a_single_kv_head_is_within_four_head_dims():
    """With one K/V head autograd skips a sum the closed form charges: 4 d bytes a token backward."""
    h, heads, kv, f, d = 392, 4, 1, 176, 128
    traced = _traced_per_token("llama", h, heads, kv, f, d)
    closed = eager_kernels.executor_bytes_per_token(_info("llama", h, heads, kv, f, d), f)
    assert closed[0] == traced[0] and abs(closed[2] - traced[2]) <= 4 * d


@pytest.mark.parametrize("h, heads", [(256, 4), (2048, 16), (1600, 25)])
def test_the_executor_gpt_count_is_its_closed_form(h, heads):
    traced = _traced_per_token("gpt", h, heads, heads, 4 * h, 0)
    closed = eager_kernels.executor_bytes_per_token(_info("gpt", h, heads, heads, 4 * h, 0), 4 * h)
    assert closed == pytest.approx(traced, rel=1e-12)


def test_the_executor_counts_on_gpus_only_and_splits_over_tp():
    """meshplan's engine on a GPU profile counts its bf16 GPT and Llama blocks; on the CPU profile
    (its calibrated factor), in fp32 or for routed experts the rule stands. Under TP the region's
    bytes split tp ways, the residual stream's only with sequence parallelism."""
    graph = profile("llama3-8b", SEQ)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    gpu, cpu = load_cluster("h100-sxm"), load_cluster("cpu")
    plain = _config(engine="meshplan", sp=False, zero=1)
    assert eager_kernels.counts_eager_kernels(block, plain, graph.info, "bf16", gpu)
    assert not eager_kernels.counts_eager_kernels(block, plain, graph.info, "bf16", cpu)
    assert not eager_kernels.counts_eager_kernels(block, _config(engine="meshplan", precision="fp32"), graph.info,
                                                  "bf16", gpu)
    fwd, fwd_stream, bwd, bwd_stream = eager_kernels.executor_bytes_per_token(graph.info, 14336)
    tokens = 2 * SEQ
    expected = (tokens * ((fwd - fwd_stream) / 2 + fwd_stream), tokens * ((bwd - bwd_stream) / 2 + bwd_stream))
    assert eager_kernels.eager_bytes(block, plain, graph.info, "bf16") == pytest.approx(expected)
    sharded = _config(engine="meshplan", sp=True, zero=1)
    assert eager_kernels.eager_bytes(block, sharded, graph.info, "bf16") == pytest.approx((tokens * fwd / 2,
                                                                                           tokens * bwd / 2))
    full = _config(engine="meshplan", sp=False, zero=1, recompute="full")  # the norms' outputs kept: none rebuilt
    rebuilt_stream, rebuilt_rest = 72 * 4096 + 16, 32
    assert eager_kernels.eager_bytes(block, full, graph.info, "bf16")[1] == pytest.approx(
        expected[1] - tokens * (rebuilt_stream + rebuilt_rest / 2))
    moe = profile("moe:layers=2,hidden=256,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=512,vocab=1024", 256)
    moe_block = next(layer for layer in moe.layers if layer.expert_params)
    assert not eager_kernels.counts_eager_kernels(moe_block, plain, moe.info, "bf16", gpu)


@pytest.mark.parametrize("spec, options", [
    ("llama:layers=2,hidden=512,heads=8,kv_heads=2,ffn=1024,vocab=1000", (False, False)),
    ("llama:layers=2,hidden=512,heads=8,kv_heads=2,ffn=1024,vocab=1000,qk_norm=1", (True, False)),
    ("llama:layers=2,hidden=512,heads=8,kv_heads=2,ffn=1024,vocab=1000,qkv_bias=1", (False, True)),
    ("llama:layers=2,hidden=512,heads=8,kv_heads=2,ffn=1024,vocab=1000,qk_norm=1,qkv_bias=1", (True, True))])
def test_the_llama_options_are_read_off_the_parameter_count(spec, options):
    graph = profile(spec, 128)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    assert eager_kernels._llama_options(block, graph.info) == options


@pytest.mark.parametrize("family, shape", [("llama", (296, 4, 2, 664, 48)), ("gpt", (256, 4, 4, 1024, 0))])
def test_full_recomputation_keeps_the_norm_outputs(family, shape):
    """Under full recomputation the executor's norms keep their outputs (`executor.parallel.recompute`):
    the Llama block's backward no longer rebuilds them, 72 h + 48 bytes a token less; GPT's LayerNorm
    never rebuilt."""
    small = eager_traffic.executor_block_bytes(family, *shape, tokens=64, norm_outputs_by_reference=False)
    large = eager_traffic.executor_block_bytes(family, *shape, tokens=128, norm_outputs_by_reference=False)
    traced = tuple((b - a) / 64 for a, b in zip(small, large))
    closed = eager_kernels.executor_bytes_per_token(_info(family, *shape), shape[3], rebuilds_norms=False)
    assert closed == pytest.approx(traced, rel=1e-12)
    kept = eager_kernels.executor_bytes_per_token(_info(family, *shape), shape[3])
    assert kept[2] - closed[2] == (72 * shape[0] + 48 if family == "llama" else 0)


# llm-foundry's MPT block (`eager_traffic._MPTBlock`, its code as the benchmarks ran it): the closed
# form the cost model prices (`eager_kernels.foundry_bytes_per_token`) against the trace and a count by hand.

def _mpt_by_hand(h: int, f: int) -> tuple[float, float, float, float]:
    """Per token (forward, its residual-stream share, backward, its share). Forward: two bf16
    LayerNorms (read 2h, write 2h, the per-token mean and rstd in fp32: 4h + 8 each), two residual
    adds (6h each), GELU (4f). Backward: the LayerNorms' (read the gradient and the input, the mean
    and rstd, write the input gradient: 6h + 8 each), two gradient sums where the residual stream
    forks (6h each), the split's backward joining q, k and v's gradients for Wqkv (read 6h, write
    6h), GELU's (read its gradient and input, write: 6f), and the bias gradients' sums over the
    tokens (read Wqkv's 6h, out_proj's 2h, up_proj's 2f, down_proj's 2h). The residual stream's
    share: the kernels h wide (the norms, the adds, the two h-wide bias gradients)."""
    forward_stream = 2 * (4 * h + 8) + 2 * 6 * h
    backward_stream = 2 * (6 * h + 8) + 2 * 6 * h + 2 * h + 2 * h
    return (forward_stream + 4 * f, forward_stream,
            backward_stream + 12 * h + 6 * f + 6 * h + 2 * f, backward_stream)


@pytest.mark.parametrize("h, heads, f", [(768, 12, 3072), (1024, 16, 4096), (2048, 16, 8192), (1024, 8, 2816)])
def test_the_foundry_mpt_count_is_its_closed_form_and_by_hand(h, heads, f):
    small = eager_traffic.foundry_block_bytes(h, heads, f, tokens=64)
    large = eager_traffic.foundry_block_bytes(h, heads, f, tokens=128)
    traced = tuple((b - a) / 64 for a, b in zip(small, large))
    closed = eager_kernels.foundry_bytes_per_token(_info("gpt", h, heads, heads, f, 0), f)
    assert closed == pytest.approx(traced, rel=1e-12)
    assert closed == pytest.approx(_mpt_by_hand(h, f), rel=1e-12)


def test_foundry_mpt_blocks_pay_the_counted_bytes_on_gpus():
    """An MPT-1B block (gpt family) at micro-batch 2 under llm-foundry on 8 GPUs with FSDP: on a GPU
    profile its counted bytes per token times the rank's 2 x 2048 tokens replace the fitted rule's
    (which charges over twice as much); on the CPU profile, for a Llama block or under another engine,
    the rule stands; the GEMMs are the same either way."""
    graph = profile("gpt:layers=2,hidden=2048,heads=16,vocab=50368", SEQ)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    gpu, cpu = load_cluster("a100-80g"), load_cluster("cpu")
    foundry = ParallelConfig(gpus=8, global_batch=16, dp=8, microbatch_size=2, zero=3, engine="llm-foundry")
    generic = ParallelConfig(gpus=8, global_batch=16, dp=8, microbatch_size=2, zero=3, engine="generic")
    assert eager_kernels.counts_eager_kernels(block, foundry, graph.info, "bf16", gpu)
    assert not eager_kernels.counts_eager_kernels(block, foundry, graph.info, "bf16", cpu)
    assert not eager_kernels.counts_eager_kernels(block, generic, graph.info, "bf16", gpu)
    llama = profile("llama:layers=2,hidden=512,heads=8,kv_heads=2,ffn=1024,vocab=1000", SEQ)
    llama_block = next(layer for layer in llama.layers if layer.kind == "block")
    assert not eager_kernels.counts_eager_kernels(llama_block, foundry, llama.info, "bf16", gpu)
    fwd, _, bwd, _ = eager_kernels.foundry_bytes_per_token(graph.info, 4 * 2048)
    tokens = 2 * SEQ
    assert eager_kernels.eager_bytes(block, foundry, graph.info, "bf16") == pytest.approx((fwd * tokens, bwd * tokens))
    counted_fwd, counted_bwd, _ = compute_times_s(block, foundry, gpu, graph.info, 1.0, 1.0, "bf16", graph.attention)
    rule_fwd, rule_bwd, _ = compute_times_s(block, generic, gpu, graph.info, 1.0, 1.0, "bf16", graph.attention)
    saved = activation_bytes(block, generic, 1.0, recompute="none")[0] + rebuilt_bytes(block, generic, 1.0)
    rule = gpu.device.elementwise_bytes_per_activation_byte
    assert rule * saved > 2 * fwd * tokens
    assert counted_fwd - rule_fwd == pytest.approx(memory_time_s(fwd * tokens, gpu) - memory_time_s(rule * saved, gpu),
                                                   rel=1e-9)
    assert counted_bwd - rule_bwd == pytest.approx(
        memory_time_s(bwd * tokens, gpu) - memory_time_s(rule * 2 * saved, gpu), rel=1e-9)


def test_foundry_fp8_blocks_leave_the_bias_gradients_to_the_casts():
    """Under fp8 llm-foundry's Linears are Transformer Engine's, which take a bias gradient inside the
    output gradient's cast: the backward loses the four sums (Wqkv 6h, out_proj 2h, up_proj 2f,
    down_proj 2h), the h-wide ones from the residual stream's share; the forward is unchanged."""
    h, heads, f = 2048, 16, 8192
    info = _info("gpt", h, heads, heads, f, 0)
    bf16, fp8 = eager_kernels.foundry_bytes_per_token(info, f), eager_kernels.foundry_bytes_per_token(info, f, True)
    assert (bf16[0] - fp8[0], bf16[1] - fp8[1], bf16[2] - fp8[2], bf16[3] - fp8[3]) == (0, 0, 10 * h + 2 * f, 4 * h)
    graph = profile("gpt:layers=2,hidden=2048,heads=16,vocab=50368", SEQ)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    config = ParallelConfig(gpus=8, global_batch=16, dp=8, microbatch_size=2, zero=3, engine="llm-foundry",
                            precision="fp8", fp8_recipe="delayed")
    assert eager_kernels.counts_eager_kernels(block, config, graph.info, "bf16", load_cluster("h100-sxm"))
    assert eager_kernels.eager_bytes(block, config, graph.info, "bf16") == pytest.approx(
        (fp8[0] * 2 * SEQ, fp8[2] * 2 * SEQ))
