"""torchtitan's per-op selective checkpointing (`costing.torchtitan_sac`).

The rule is checked against torch itself: a block shaped as torchtitan's Llama block (its
Attention's wq, wk, wv, SDPA, wo; its FeedForward's w2(silu(w1 x) * w3 x)) wrapped in torch's
selective checkpoint under torchtitan's policy (save `aten.mm` outputs except every second one,
and SDPA's; recompute the rest) runs in backward exactly the extra matmuls meshplan says it
reruns: the multiset of extra mm shapes a dispatch mode records in backward, and their FLOPs,
equal the prediction, exactly (integer counts). The time rule is checked against the parts `layer_cost`
reports, to floating-point tolerance (1e-9 relative)."""
from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import gemm, torchtitan_sac
from meshplan.planner.costing.device_time import infer_seq
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.profiling.profiler import profile

HIDDEN, HEADS, KV_HEADS, FFN, SEQ, BATCH = 64, 4, 2, 160, 32, 2
SPEC = f"llama:layers=2,hidden={HIDDEN},heads={HEADS},kv_heads={KV_HEADS},ffn={FFN},vocab=256"
H100 = load_cluster("h100-sxm")
SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, torch.ops.aten.max.default}


class LlamaBlock(nn.Module):
    """torchtitan's Llama block's Linears and their order (RoPE left out: elementwise, rerun alike)."""

    def __init__(self):
        super().__init__()
        head_dim = HIDDEN // HEADS
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.wq = nn.Linear(HIDDEN, HEADS * head_dim, bias=False)
        self.wk = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)
        self.wv = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)
        self.wo = nn.Linear(HEADS * head_dim, HIDDEN, bias=False)
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w3 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x).reshape(b * s, HIDDEN)  # 2-D inputs: each Linear is one aten.mm
        q = self.wq(h).view(b, s, HEADS, -1).transpose(1, 2)
        k = self.wk(h).view(b, s, KV_HEADS, -1).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = self.wv(h).view(b, s, KV_HEADS, -1).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b * s, -1)
        x = x + self.wo(attn).view(b, s, HIDDEN)
        g = self.norm2(x).reshape(b * s, HIDDEN)
        return x + self.w2(F.silu(self.w1(g)) * self.w3(g)).view(b, s, HIDDEN)


def _policy(meta, ctx, func, *args, **kwargs):
    mode = "recompute" if ctx.is_recompute else "forward"
    if func == torch.ops.aten.mm.default:
        meta[mode] += 1
    save = func in SAVED_OPS and not (func == torch.ops.aten.mm.default and meta[mode] % 2 == 0)
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


class _MatmulShapes(TorchDispatchMode):
    """The (rows, inner, cols) of every aten.mm that runs under it."""

    def __init__(self):
        super().__init__()
        self.shapes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == torch.ops.aten.mm.default:
            self.shapes[(*args[0].shape, args[1].shape[1])] += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(sac: bool, recipe: str | None = None) -> tuple[Counter, float]:
    torch.manual_seed(0)
    block = LlamaBlock()
    if recipe:  # torchao's Float8 Linears, as torchtitan's float8 converter swaps them in
        float8 = pytest.importorskip("torchao.float8")
        float8.convert_to_float8_training(block, config=float8.Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    if sac:
        context = partial(create_selective_checkpoint_contexts, partial(_policy, {"forward": 0, "recompute": 0}))
        out = checkpoint(block, x, use_reentrant=False, context_fn=context)
    else:
        out = block(x)
    grad = torch.ones_like(out)
    with _MatmulShapes() as recorded:  # under the rerun's caching mode: it sees the matmuls that really run
        out.backward(grad)
    return recorded.shapes, sum(2 * m * k * n * count for (m, k, n), count in recorded.shapes.items())


@pytest.mark.parametrize("recipe", [None, "tensorwise", "rowwise"])
def test_torchs_selective_checkpoint_reruns_the_matmuls_meshplan_prices(recipe):
    """bf16, and torchao's Float8 Linears: the policy sees their product as `aten.mm` on torchao's
    subclass, so Float8 blocks rerun the same Linears (wk, wo, w3) and save the others."""
    plain_shapes, plain_flops = _backward_matmuls(sac=False, recipe=recipe)
    sac_shapes, sac_flops = _backward_matmuls(sac=True, recipe=recipe)
    rerun = sac_shapes - plain_shapes
    graph = profile(SPEC, SEQ)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    shapes = gemm.block_linear_shapes(block, graph.info, infer_seq(block, graph.info, graph.dtype))
    predicted = torchtitan_sac.recomputed_linear_shapes(shapes)
    tokens = BATCH * SEQ
    assert rerun == Counter((tokens, i, o) for i, o, _ in predicted)  # wk, wo, w3
    assert sac_flops - plain_flops == gemm.linear_flops(predicted, tokens, 1)
    saved = torchtitan_sac.saved_linear_shapes(shapes)
    assert len(saved) + len(predicted) == len(shapes) == 7 and set(saved) | set(predicted) == set(shapes)


def _config(**changes) -> ParallelConfig:
    base = dict(gpus=8, global_batch=16, dp=8, zero=3, microbatch_size=2, engine="torchtitan", recompute="selective")
    return ParallelConfig(**{**base, **changes})


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp8"])
def test_the_rerun_is_the_forward_less_attention_and_saved_gemms(precision):
    graph = profile("llama3-8b", 8192, attention="sdpa-flash")
    block = next(layer for layer in graph.layers if layer.kind == "block")
    fp8 = dict(fp8_recipe="tensorwise") if precision == "fp8" else {}
    sac = layer_cost(block, _config(precision=precision, **fp8), H100, graph.info, profile_dtype=graph.dtype,
                     attention="sdpa-flash")
    megatron_style = layer_cost(block, _config(precision=precision, engine="meshplan", **fp8), H100, graph.info,
                                profile_dtype=graph.dtype, attention="sdpa-flash")  # the attention core's rerun
    shapes = gemm.block_linear_shapes(block, graph.info, 8192)
    saved_s = gemm.linear_times_s(shapes[0::2], 2 * 8192, 1, H100, "fp8" if precision == "fp8" else "bf16")[0]
    assert megatron_style.recompute_s > 0
    expected = sac.fwd_compute_s - H100.device.dp_unit_overhead_s - megatron_style.recompute_s - saved_s
    assert sac.recompute_s == pytest.approx(expected, rel=1e-9)


def test_embedding_and_output_rerun_nothing_and_tp_repeats_the_gathers():
    graph = profile("llama3-8b", 8192, attention="sdpa-flash")
    for layer in graph.layers:
        if layer.kind != "block":
            cost = layer_cost(layer, _config(), H100, graph.info, profile_dtype=graph.dtype, attention="sdpa-flash")
            assert cost.recompute_s == 0.0
    block = next(layer for layer in graph.layers if layer.kind == "block")
    tp = dict(gpus=8, dp=2, tp=4, sp=True, global_batch=4, microbatch_size=2)
    sac = layer_cost(block, _config(**tp), H100, graph.info, profile_dtype=graph.dtype, attention="sdpa-flash")
    full = layer_cost(block, _config(**tp, recompute="full"), H100, graph.info, profile_dtype=graph.dtype,
                      attention="sdpa-flash")  # reruns every forward collective, SAC only the all-gathers
    assert full.tp_fwd_comm_s > 0
    assert sac.tp_bwd_comm_s == pytest.approx(full.tp_bwd_comm_s - 0.5 * full.tp_fwd_comm_s, rel=1e-9)


def test_a_moe_block_reruns_and_drops_its_routed_experts():
    """torchtitan's list names no grouped GEMM: a MoE block's routed experts rerun (their forward
    time joins the rerun) and their saved bytes leave the activations for the working set."""
    graph = profile("moe:layers=2,hidden=512,heads=8,kv_heads=8,vocab=1024,experts=8,top_k=2,expert_ffn=256", 1024)
    block = next(layer for layer in graph.layers if layer.expert_params)
    config = dict(gpus=8, global_batch=16, dp=8, zero=3, microbatch_size=2, engine="torchtitan")
    sac = layer_cost(block, ParallelConfig(**config, recompute="selective"), H100, graph.info,
                     profile_dtype=graph.dtype)
    none = layer_cost(block, ParallelConfig(**config), H100, graph.info, profile_dtype=graph.dtype)
    experts_bytes = block.expert_act_bytes * 2  # micro-batch 2, balanced routing, no TP
    assert sac.expert_fwd_s > 0 and sac.recompute_s > sac.expert_fwd_s
    assert none.activation_bytes - sac.activation_bytes >= experts_bytes > 0


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp8"])
def test_the_policy_keeps_the_input_attention_and_the_saved_linears_outputs(precision):
    """Memory from the same rule as time (`saved_linear_shapes`): per token of Llama 3 8B, bf16 2 bytes
    a value, the block input (h), attention's output (hq) and fp32 log-sum-exp (4 bytes a head), and
    the outputs of wq, wv, w1 and w2 (hq + hkv + f + h) in bf16, under Float8 too (their products'
    outputs are bf16)."""
    graph = profile("llama3-8b", 8192, attention="sdpa-flash")
    block = next(layer for layer in graph.layers if layer.kind == "block")
    fp8 = dict(fp8_recipe="tensorwise") if precision == "fp8" else {}
    cost = layer_cost(block, _config(precision=precision, **fp8), H100, graph.info, profile_dtype=graph.dtype,
                      attention="sdpa-flash")
    h, hq, hkv, f, heads = 4096, 4096, 1024, 14336, 32
    linears = hq + hkv + f + h
    assert cost.activation_bytes / (2 * 8192) == pytest.approx(2 * h + 2 * hq + 4 * heads + 2 * linears, rel=1e-9)
