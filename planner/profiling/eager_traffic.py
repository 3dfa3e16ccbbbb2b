"""The memory traffic of a block's elementwise kernels run eagerly, counted op by op.

Fused engines (Megatron-Core with Transformer Engine, torch.compile) run a block's norms, rotary
embedding, SwiGLU and residual adds as a few fused kernels, whose traffic the profile's fitted
`elementwise_bytes_per_activation_byte` describes. torchtitan without torch.compile runs its
Llama block as its code writes it, one kernel per aten op: its RMSNorm in fp32
(`x.float()`, `pow`, `mean`, `rsqrt`, two multiplies, `type_as`: torchtitan's own RMSNorm class of
2024, torch's composite `rms_norm` before its fused CUDA kernel), its rotary embedding through
complex fp32 multiplies (`apply_rotary_emb`), `repeat_kv`'s copies for grouped-query attention,
SwiGLU as `silu(w1 x) * w3 x`, two residual adds; and autograd runs each op's backward as kernels
of its own. `block_bytes` traces that block on the meta device under a dispatch mode and sums,
per kernel, the bytes it reads and writes (each tensor's storage once; views, matmuls and the
attention kernel excluded: the GEMMs and attention are priced by shape), forward and backward.
`foundry_block_bytes` counts llm-foundry's MPT block the same way (`MPTBlock` as its benchmarks
ran it, `_MPTBlock`), and `executor_block_bytes` meshplan's own executor block. Nothing is
fitted: the count is the code's.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Matmuls (priced by shape) and allocations move no elementwise traffic; views move none.
NOT_COUNTED = frozenset({"mm", "bmm", "addmm", "empty_like", "empty", "zeros_like", "ones_like", "full_like",
                         "view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "transpose", "t",
                         "permute", "view_as_complex", "view_as_real", "slice", "select", "alias", "detach",
                         "as_strided", "_reshape_alias", "split", "split_with_sizes", "unbind"})
TOKENS = 64  # traced tokens: the count is linear in them (per-token figures)


class _Attention(torch.autograd.Function):
    """The fused attention kernel as a stand-in: its traffic is `attention_kernels`' to price."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        k, v = ctx.saved_tensors
        return torch.empty_like(grad), torch.empty_like(k), torch.empty_like(v)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _rotary(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk))


def _repeat_kv(x, n_rep: int):
    batch, seq, heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x.unsqueeze(3).expand(batch, seq, heads, n_rep, head_dim).reshape(batch, seq, heads * n_rep, head_dim)


class _Block(nn.Module):
    """torchtitan's Llama TransformerBlock, its elementwise ops as its code writes them."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=False)
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.attention_norm, self.ffn_norm = _RMSNorm(hidden), _RMSNorm(hidden)

    def forward(self, x, freqs_cis):
        batch, seq, _ = x.shape
        y = self.attention_norm(x)
        q = self.wq(y).view(batch, seq, self.heads, self.head_dim)
        k = self.wk(y).view(batch, seq, self.kv_heads, self.head_dim)
        v = self.wv(y).view(batch, seq, self.kv_heads, self.head_dim)
        q, k = _rotary(q, k, freqs_cis)
        rep = self.heads // self.kv_heads
        k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
        out = _Attention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = x + self.wo(out.transpose(1, 2).contiguous().view(batch, seq, -1))
        z = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(z)) * self.w3(z))


def _tensor_bytes(t: torch.Tensor) -> int:
    # a view reads its elements, an expanded one its storage: whichever is smaller
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class _Traffic(TorchDispatchMode):
    """Bytes the counted kernels read and write; with `hidden`, also the residual stream's share
    (`stream`): kernels whose largest tensor is `hidden` wide (the norms, the residual adds,
    replicated over TP unless sequence parallelism shards them), the rest lying inside the TP
    region (heads, the MLP's width: split over TP)."""

    def __init__(self, hidden: int = 0):
        super().__init__()
        self.hidden, self.bytes, self.stream = hidden, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ not in NOT_COUNTED:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            moved = sum(_tensor_bytes(t) for t in tensors)
            self.bytes += moved
            largest = max(tensors, key=lambda t: t.numel(), default=None)
            if self.hidden and largest is not None and largest.dim() >= 1 and largest.shape[-1] == self.hidden:
                self.stream += moved
        return out


def _trace(block: nn.Module, hidden: int, *inputs) -> tuple[_Traffic, _Traffic]:
    """(forward, backward) traffic of one pass of `block` on the meta device's `inputs`."""
    forward, backward = _Traffic(hidden), _Traffic(hidden)
    with forward:
        out = block(*inputs)
    grad = torch.empty_like(out)
    with backward:
        out.backward(grad)
    return forward, backward


@lru_cache(maxsize=None)
def block_bytes(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                tokens: int = TOKENS) -> tuple[float, float]:
    """(forward, backward) bytes per token the eager block's elementwise kernels move over `tokens`
    tokens (bf16 activations and weights, a norm's weight read once for all of them), traced on the
    meta device; `costing.eager_kernels.torchtitan_bytes_per_token` writes it in closed form."""
    with torch.device("meta"):
        block = _Block(hidden, heads, kv_heads, head_dim, ffn).to(torch.bfloat16)
        x = torch.empty(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        freqs_cis = torch.empty(tokens, head_dim // 2, dtype=torch.complex64)
        forward, backward = _trace(block, 0, x, freqs_cis)
    return forward.bytes / tokens, backward.bytes / tokens


def _stand_in_sdpa(q, k, v, *args, **kwargs):
    """`F.scaled_dot_product_attention` as the fused kernel's stand-in (`_Attention`)."""
    return _Attention.apply(q, k, v)


def executor_block_bytes(family: str, hidden: int, heads: int, kv_heads: int, ffn: int, head_dim: int = 0,
                         qk_norm: bool = False, qkv_bias: bool = False, tokens: int = TOKENS,
                         norm_outputs_by_reference: bool = True) -> tuple[float, float, float, float]:
    """(forward, forward on the residual stream, backward, backward on the residual stream) bytes
    that meshplan's own executor block (`models.transformer.Block`, GPT or Llama, bf16, as `meshplan
    train` runs it, op by op) moves in its elementwise kernels over `tokens` tokens, traced on the
    meta device as `block_bytes` traces torchtitan's: its norms (a LayerNorm, or the RMSNorm whose
    statistics and backward run in fp32), RoPE in the compute dtype, SwiGLU with its fp32 backward
    or GELU, the residual adds, the norm outputs rebuilt in backward (`transformer.normed_call`) and
    autograd's gradient sums; the Linears' GEMMs and the attention kernel excluded. The residual
    stream's share (`_Traffic.stream`) stays whole under TP without sequence parallelism.
    `norm_outputs_by_reference` false: as under full recomputation (`executor.parallel.recompute`),
    the norms keep their outputs and nothing is rebuilt in backward. Two token
    counts' difference gives the per-token count without the weight-sized terms (a norm's weight
    and its gradient), which `costing.eager_kernels.executor_bytes_per_token` writes in closed form."""
    from unittest import mock

    from meshplan.planner.models.config import TransformerConfig
    from meshplan.planner.models.transformer import Block

    llama = dict(ffn=ffn, attn_head_dim=head_dim, qk_norm=qk_norm, qkv_bias=qkv_bias) if family != "gpt" else {}
    cfg = TransformerConfig(family, 1, hidden, heads, 128, num_kv_heads=kv_heads, max_positions=tokens, **llama)
    with torch.device("meta"), mock.patch.object(F, "scaled_dot_product_attention", _stand_in_sdpa):
        block = Block(cfg).to(torch.bfloat16)
        for module in block.modules():
            if hasattr(module, "output_by_reference"):
                module.output_by_reference = norm_outputs_by_reference
        x = torch.empty(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        forward, backward = _trace(block, hidden, x)
    return forward.bytes, forward.stream, backward.bytes, backward.stream


class _MPTBlock(nn.Module):
    """llm-foundry's MPTBlock as its training benchmarks ran it (llmfoundry/models/layers/blocks.py,
    attention.py, ffn.py and norm.py of October 2023; scripts/train/benchmarking/submit_benchmarks.py):
    `low_precision_layernorm` (LPLayerNorm: the input and affine parameters in the autocast dtype, one
    `layer_norm` kernel in bf16), the fused Wqkv Linear with its bias, its output split into q, k and v
    and viewed per head for the Triton flash-attention kernel (`attn_impl: triton`, which takes the
    views as they are: their last dimension is contiguous), out_proj, the residual add (its dropout at
    `resid_pdrop: 0` returns its input: no kernel), then LayerNorm, up_proj, exact GELU, down_proj and
    the second residual add; every Linear with a bias (`no_bias` defaults to false), one cuBLAS GEMM
    with its bias in the epilogue forward, and a bias gradient (a sum over the tokens) backward."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm_1, self.norm_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.Wqkv, self.out_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up_proj, self.down_proj = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.act = nn.GELU(approximate="none")
        self.resid_attn_dropout, self.resid_ffn_dropout = nn.Dropout(0.0), nn.Dropout(0.0)

    def forward(self, x):
        batch, seq, hidden = x.shape
        query, key, value = self.Wqkv(self.norm_1(x)).split([hidden] * 3, dim=2)
        query, key, value = (t.view(batch, seq, self.heads, hidden // self.heads) for t in (query, key, value))
        context = _Attention.apply(query, key, value).reshape(batch, seq, hidden)
        x = x + self.resid_attn_dropout(self.out_proj(context))
        return x + self.resid_ffn_dropout(self.down_proj(self.act(self.up_proj(self.norm_2(x)))))


@lru_cache(maxsize=None)
def foundry_block_bytes(hidden: int, heads: int, ffn: int, tokens: int = TOKENS) -> tuple[float, float, float, float]:
    """(forward, forward on the residual stream, backward, backward on the residual stream) bytes
    llm-foundry's eager MPT block (`_MPTBlock`, bf16) moves in its elementwise kernels over `tokens`
    tokens, traced on the meta device as `block_bytes` traces torchtitan's; the Linears' GEMMs and the
    attention kernel excluded. `costing.eager_kernels.foundry_bytes_per_token` writes it per token in
    closed form (two token counts' difference drops the weight-sized terms)."""
    with torch.device("meta"):
        block = _MPTBlock(hidden, heads, ffn).to(torch.bfloat16)
        x = torch.empty(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        forward, backward = _trace(block, hidden, x)
    return forward.bytes, forward.stream, backward.bytes, backward.stream
