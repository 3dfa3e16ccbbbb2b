"""Decoder-only transformers (GPT and Llama families) in plain PyTorch, meta-device friendly.

Module boundaries are the ones parallelism needs (torchtitan's layout):
  `embed`  -> one node / the first pipeline stage's entry (vocab-parallel under TP),
  `blocks` -> nn.ModuleList of identical blocks (attention q/k/v/o Linears, MLP column->row pair),
  `head`   -> final norm + output Linear (vocab-parallel under TP); the loss is `lm_loss`.
Attention infers its local head count from the projection width, so it keeps working after
tensor parallelism shards q/k/v by heads.

The Llama block runs as real engines run it: grouped-query attention inside SDPA
(`enable_gqa`, K and V never expanded to all heads), RMSNorm as one fused op that keeps its input
and an fp32 rstd (statistics in fp32, output in the compute dtype), RoPE in the compute dtype.
What one block saves for backward, per token, in bf16 with flash attention (h hidden, a heads,
d = h/a, d_kv = kv_heads * d, f the SwiGLU width): outside the TP region each norm's input (2h)
and rstd (4), 4h + 8 (the Linears after a norm keep its output as a reference, rebuilt in
backward from the norm's input: `normed_call`, as Megatron-Core's norm recomputation does);
inside it RoPE's bf16 cos/sin tables (2d), the attention kernel's q (2h), k and v (4 d_kv),
output (2h) and fp32 log-sum-exp (4a), which the o Linear keeps by reference for its input (a
`SavedReference`: CUDA flash kernels write the output heads-last, so merging heads is a view;
where a kernel writes it heads-major the copy is rebuilt in backward rather than kept), and the
fused SwiGLU's gate and up outputs and the down Linear's input (6f): 8h + 4 d_kv + 6f + 4a + 2d
+ 8 bytes in all. Korthikanti et al. (2022) give 34*s*b*h + 5*a*s^2*b for a GPT block (math
attention, fp16, dropout), 34*s*b*h with flash attention; without dropout's two 1-byte masks
that is 32, what the profiler measures for the zoo's GPT block (32h + 4a + 16 per token; its
LayerNorms' outputs are kept, as Korthikanti counts them). Measured by the profiler at s = 8192:
llama3-8b 123,272 bytes per token per layer (30.1*s*b*h; 254,600 = 62.2*s*b*h with fp32
norm/RoPE, expanded K/V, unfused SwiGLU, kept norm outputs and a kept copy of the merged heads),
llama3-405b 455,432 (27.8*s*b*h; was 984,072 = 60.1*s*b*h). Against GPT's 32: SwiGLU's 6f = 21h
(8b) and 19.5h (405b) against GELU's 16h, offset by GQA's 4 d_kv = h/4 and h/16 against MHA's
4h, and the 4h of norm outputs rebuilt.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.planner.models.saved_reference import SavedReference, local_tensor, storage_id

from meshplan.planner.models.config import TransformerConfig  # noqa: F401  (re-exported: callers import it from here)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, fp32 rstd): statistics in fp32, the output `(x * rstd).type_as(x) * weight`."""
    x_fp32 = x.float()
    rstd = torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return (x_fp32 * rstd).type_as(x) * weight, rstd


class _FusedRMSNorm(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * weight, computed like a fused kernel.

    It keeps for backward what fused kernels keep (torch's CUDA `_fused_rms_norm`, Megatron/TE,
    apex): the input in its own dtype and one fp32 rstd per row. Written as plain ops, autograd
    also keeps fp32 copies of x: 10 bytes per element of x in bf16 against 2 (measured);
    `F.rms_norm` is such a composition on CPU and meta (8 bytes per element), so it saves more.
    Statistics and the backward are computed in fp32; the forward output is bitwise the
    plain-ops formula's (`(x.float() * rstd).type_as(x) * weight`) in every dtype.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_normed = grad_out.float() * weight.float()
            # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed)) along the normalised dim
            grad_x = (rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))).type_as(x)
        if ctx.needs_input_grad[1]:
            # the forward multiplied the weight by normed rounded to x's dtype: differentiate that
            rounded = normed.type_as(x).float()
            grad_w = (grad_out.float() * rounded).sum(tuple(range(x.dim() - 1))).type_as(weight)
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedRMSNorm.apply(x, self.weight, self.eps)

    @torch.no_grad()
    def rebuild(self, x: torch.Tensor) -> torch.Tensor:
        """The forward's output for input `x`, bitwise, as a plain (local) tensor: the same ops
        on the local shards of `x` and of the weight as the module uses now (under FSDP, in
        backward, its gathered copy). Called outside the module, so no module hook fires."""
        return _rms_norm(local_tensor(x), local_tensor(self.weight), self.eps)[0]

    # The output is kept for the Linears after the norm as a reference, rebuilt in backward from
    # the input the norm keeps anyway (`normed_call`). Off under activation checkpointing
    # (`executor.parallel.recompute`), whose recomputation keeps nothing across the forward.
    output_by_reference = True


def normed_call(norm: nn.Module, x: torch.Tensor, consumer) -> torch.Tensor:
    """`consumer(norm(x))`, where the consumer's Linears keep the norm's output for backward.

    A norm with `output_by_reference` (the fused RMSNorm) lets them keep a reference instead and
    rebuilds the output from `x` when their backward first needs it, as Megatron-Core's norm
    recomputation does (`CheckpointWithoutOutput`): the norm keeps `x` and its rstd anyway, so
    2 bytes per hidden element per token less for one memory-bound norm in backward.
    """
    y = norm(x)
    if not getattr(norm, "output_by_reference", False):
        return consumer(y)
    kept = _NormOutput(local_tensor(y), lambda: norm.rebuild(x))
    with kept.saving():
        return consumer(y)


class _NormOutput(SavedReference):
    """The norm's output, rebuilt once per backward for the Linears that saved it."""

    # Called with each reference when something saves it (the profiler counts the bytes the
    # backward rebuilds, `planner.profiling.tracing`).
    observers: list = []

    def __init__(self, target, make):
        super().__init__(target, make)
        self.nbytes = target.untyped_storage().nbytes()

    def packed(self) -> None:
        for observe in self.observers:
            observe(self)


def _norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.family == "gpt":
        return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden, cfg.norm_eps)


def rope_tables(seq: int, head_dim: int, theta: float, device=None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq, head_dim / 2), computed on the fly (no buffers to shard), for
    positions 0..seq-1 or the given `positions` (a context-parallel rank's tokens)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if positions is None:
        positions = torch.arange(seq, device=device)
    angles = torch.outer(positions.to(device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) in x's dtype; x is (batch, heads, seq, head_dim).

    The tables are cast to x's dtype (a no-op when the caller already did): the rotation then
    saves only the tables for backward, in the compute dtype, and no fp32 copy of x.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    # Context parallelism (`executor.parallel.context.SequenceShard`, set by the executor): this
    # rank's token positions, and `attend(q, k, v)`: causal attention of the rank's tokens over the
    # whole sequence (K/V all-gathered, or Ulysses' all-to-alls). None: the module holds whole sequences.
    context = None

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        bias = cfg.family == "gpt"
        qkv_bias = bias or cfg.qkv_bias
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta if cfg.family != "gpt" else 0.0
        self.q = nn.Linear(cfg.hidden, cfg.num_heads * cfg.head_dim, bias=qkv_bias)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.o = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden, bias=bias)
        # Qwen3: RMSNorm over each head of q and k (one head_dim weight each), before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (batch, seq, local_heads * head_dim) -> (batch, local_heads, seq, head_dim)
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta:
            # Angles in fp32 (positions up to 1e5+ need its mantissa), cast once so that q and k
            # share one saved pair of tables in the compute dtype.
            positions = self.context.positions if self.context is not None else None
            cos, sin = (t.to(q.dtype) for t in rope_tables(seq, self.head_dim, self.rope_theta, device=x.device,
                                                           positions=positions))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Grouped-query attention: the kernel maps each group of q heads onto its shared KV head,
        # so K and V stay at kv heads (no expanded copies saved). The local counts come from the
        # projection widths, so the ratio holds after TP shards q, k and v by heads.
        if self.context is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        else:  # this rank's tokens attend over the whole sequence, as the context's CP method exchanges it
            out = self.context.attend(q, k, v)
        merged = out.transpose(1, 2).reshape(batch, seq, -1)
        if not self.merged_heads_by_reference or storage_id(merged) == storage_id(out):
            return self.o(merged)
        # A copy (CPU kernels return heads-major output; CUDA flash kernels write (b, s, h, d), of
        # which this is a view): the o Linear keeps a reference to the kernel's output instead,
        # which the kernel keeps anyway, and merges the heads again when its backward needs them.
        shape = merged.shape
        kept = SavedReference(merged, lambda: out.transpose(1, 2).reshape(shape))
        with kept.saving():
            return self.o(merged)

    # Off under activation checkpointing (`executor.parallel.recompute`), whose recomputation
    # keeps nothing across the forward; the reference would keep the kernel's output alive.
    merged_heads_by_reference = True


class _FusedSwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping for backward only its two inputs (as fused kernels do).

    Plain ops keep gate, silu(gate) and up (the product's input is kept by the down Linear
    anyway); Megatron's and Transformer Engine's fused SwiGLU keep the two inputs and recompute
    silu in backward, a few elementwise FLOPs for one f-wide tensor less per token. Backward
    works in fp32 and rounds once, like the fused kernels.
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        gate_fp32, grad_fp32 = gate.float(), grad_out.float()
        sig = torch.sigmoid(gate_fp32)
        silu = gate_fp32 * sig
        grad_up = (grad_fp32 * silu).type_as(up)
        # d silu(g)/dg = sig * (1 + g * (1 - sig))
        grad_gate = (grad_fp32 * up.float() * sig * (1 + gate_fp32 * (1 - sig))).type_as(gate)
        return grad_gate, grad_up


class MLP(nn.Module):
    """GELU MLP (GPT: fc -> proj) or SwiGLU (Llama: gate, up -> down). Column Linears first."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.swiglu = cfg.family != "gpt"
        bias = cfg.family == "gpt"
        if self.swiglu:
            self.gate = nn.Linear(cfg.hidden, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn_dim, bias=bias)
        self.down = nn.Linear(cfg.ffn_dim, cfg.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(_FusedSwiGLU.apply(self.gate(x), self.up(x)))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + normed_call(self.attn_norm, x, self.attn)
        return x + normed_call(self.mlp_norm, x, self.mlp)


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding; on the meta device its N(0, 1) init is skipped: meta `normal_` goes through
    torch's Python reference kernels, whose first use imports ~1.5 s of modules for no values."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Embedding(nn.Module):
    context = None  # as Attention.context: learned positions follow the rank's token positions

    def __init__(self, cfg: TransformerConfig, padded_vocab: int):
        super().__init__()
        self.tok = _embedding(padded_vocab, cfg.hidden)
        self.pos = _embedding(cfg.max_positions, cfg.hidden) if cfg.family == "gpt" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        if self.pos is not None:
            positions = (self.context.positions.to(tokens.device) if self.context is not None
                         else torch.arange(tokens.shape[-1], device=tokens.device))
            h = h + self.pos(positions)
        return h


class Head(nn.Module):
    def __init__(self, cfg: TransformerConfig, padded_vocab: int):
        super().__init__()
        self.norm = _norm(cfg)
        self.proj = nn.Linear(cfg.hidden, padded_vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return normed_call(self.norm, h, self.proj)


class CausalLM(nn.Module):
    """embed -> blocks -> head; `forward(tokens) -> logits` of shape (batch, seq, padded_vocab)."""

    def __init__(self, cfg: TransformerConfig, tp: int = 1):
        super().__init__()
        self.cfg = cfg
        self.padded_vocab = cfg.padded_vocab(tp)
        self.embed = Embedding(cfg, self.padded_vocab)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg, self.padded_vocab)
        if cfg.tied_embeddings:
            self.head.proj.weight = self.embed.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in fp32 (targets are already shifted)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic init from `seed`, by parameter name order, independent of the device.

    Linears and embeddings ~ N(0, std) (output projections scaled by 1/sqrt(2 * layers) as in
    GPT-2), biases 0, norm weights 1. Values are drawn on CPU so every rank and the single-process
    reference get identical full tensors for the same seed.
    """
    for _, param, values in iter_init_values(model, seed, std):
        param.copy_(values.to(dtype=param.dtype, device=param.device))


@torch.no_grad()
def iter_init_values(model: nn.Module, seed: int, std: float = 0.02):
    """Yield (name, param, full fp32 CPU values) in `init_weights` order, one parameter at a time.

    The model may live on the meta device: a sharded executor draws every value in the same
    order and keeps only its own slices, so it never holds more than one full parameter.
    """
    generator = torch.Generator().manual_seed(seed)
    num_layers = len(getattr(model, "blocks", [])) or 1
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in seen:
            continue
        seen.add(id(param))
        if name.endswith("bias"):
            values = torch.zeros(param.shape)
        elif "norm" in name:
            values = torch.ones(param.shape)
        else:
            scale = std / math.sqrt(2 * num_layers) if name.endswith(("o.weight", "down.weight")) else std
            values = torch.randn(param.shape, generator=generator) * scale
        yield name, param, values
