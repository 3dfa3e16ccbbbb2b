"""Recurrent mixers of Hugging Face models on the meta device (Mamba, Mamba-2, gated DeltaNet): each
scan as its fused kernel runs it.

Without `mamba_ssm` (and on the meta device there is no kernel to run), transformers' Mamba,
Falcon-Mamba, Jamba and Zamba scan in a Python loop over the sequence that keeps every step's d_inner x d_state
state for backward: a trace of seconds per layer, and saved activations about ten times those of
the fused `selective_scan` that real training runs. While meshplan traces a model on the meta
device (`scan_as_kernel`), the scan is `KernelScan` instead, which keeps what mamba_ssm's
`SelectiveScanFn` keeps for its backward (Gu and Dao 2023, the `mamba_ssm` CUDA kernel):

- its inputs u and delta (b x d x L), B and C (b x N x L), A, D, the gate z and delta's bias;
- the output (b x d x L), and the scan's state at the end of every chunk of 2,048 positions
  (b x d x chunks x 2N, fp32: the kernel's checkpoints, its backward re-runs the scan from them).

FLOPs: the scan is elementwise work, 9 L d N multiply-adds and exponentials per sample
(`mamba_ssm`'s own count), about 1% of a Mamba block's matmul FLOPs; meshplan counts matmul FLOPs
only (`planner.profiling.op_audit`), so the scan's time is its memory traffic, priced from the
bytes above as every elementwise operation's is.

Mamba-2's chunked scan (state space duality; Dao and Gu 2024) runs in transformers' torch path as
einsums over fp32 (chunk x chunk) score blocks per head, every one of them kept for backward: at
8K tokens several GiB a layer where `mamba_ssm`'s `mamba_chunk_scan_combined` keeps a few hundred
MiB. While tracing, `mamba2_chunk_scan` (the shared function of transformers' Mamba-2, Bamba,
Falcon-H1, Granite-MoE-hybrid, Nemotron-H and Zamba-2 modules) is `KernelSSD` instead, which keeps
what that kernel's `MambaChunkScanCombinedFn` keeps: its output, x, dt, the fp32 cumulative decay
dA_cumsum (b x heads x chunks x chunk), A, B, C, D and dt's bias. Its FLOPs are the kernel's four
batched products per chunk (`ssd_products`: C B^T per group, the masked scores times x, the chunk
states B^T x and their read-out C h), each run on the meta device so the FLOP counter sees them;
backward runs each twice (the gradients of both operands).

Gated DeltaNet (Yang et al. 2025; Qwen3-Next, Qwen3.5, OLMo-hybrid) runs in transformers' torch path
with a triangular solve meshplan's FLOP counter has no formula for, in fp32 copies of every input.
While tracing, `torch_chunk_gated_delta_rule` is `KernelGDN` instead, which keeps what flash-linear-
attention's `ChunkGatedDeltaRuleFunction` keeps (q and k after their in-kernel L2 norm with their fp32
rstd, v, the fp32 chunk-cumulative gate g, beta and the inverted chunk matrix A, b x L x heads x 64) and
counts the chunk algorithm's products (`gdn_products`, per value head and chunk of C = 64: the
k k^T system and its triangular inverse, w and u, the state's read and update, the output's q h and
masked q k^T v); its backward recomputes w, u and the states, as the kernel does, and runs every
product's two gradients.
"""
from __future__ import annotations

import contextlib
import functools

# transformers' modeling modules whose `mamba_selective_scan` is the looped reference scan
SCAN_MODULES = tuple(f"transformers.models.{name}.modeling_{name}" for name in ("mamba", "falcon_mamba", "jamba",
                                                                                  "zamba"))
# transformers' modeling modules whose `mamba2_chunk_scan` is the einsum reference of Mamba-2's scan
SSD_MODULES = tuple(f"transformers.models.{name}.modeling_{name}" for name in (
    "mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2"))
# the logger of transformers' hub-kernel dispatch, which warns when a kernel falls back to torch code
KERNEL_NOTICE_LOGGER = "transformers.integrations.hub_kernels"
# transformers' modeling modules whose `torch_chunk_gated_delta_rule` is gated DeltaNet's torch path
GDN_MODULES = tuple(f"transformers.models.{name}.modeling_{name}" for name in (
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "lara_mini", "qwen4_exp"))
# positions per chunk of flash-linear-attention's gated delta rule kernels
GDN_CHUNK = 64
# positions per chunk of mamba_ssm's selective-scan kernel (its checkpointed states)
KERNEL_CHUNK = 2048


@functools.cache  # one autograd Function class, not one per traced layer
def _kernel_scan_class():
    import torch

    class KernelScan(torch.autograd.Function):
        """The fused selective scan's shapes and saved tensors (module docstring); meta only."""

        @staticmethod
        def forward(ctx, u, delta, A, B, C, D, z, delta_bias):
            batch, width, seq = u.shape
            chunks = -(-seq // KERNEL_CHUNK)
            states = u.new_empty(batch, width, chunks, 2 * A.shape[-1], dtype=torch.float32)
            out = u.new_empty(u.shape)
            ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states, out)
            return out if z is None else out.new_empty(out.shape)

        @staticmethod
        def backward(ctx, grad):
            saved = ctx.saved_tensors[:8]
            return tuple(None if t is None else t.new_empty(t.shape) for t in saved)

    return KernelScan


def kernel_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                return_last_state=False, **kwargs):
    """transformers' `mamba_selective_scan` signature, run as `KernelScan`."""
    out = _kernel_scan_class().apply(hidden_states, dt, A, B, C, D, z, delta_bias)
    if return_last_state:
        return out, hidden_states.new_empty(hidden_states.shape[0], hidden_states.shape[1], A.shape[-1])
    return out


def ssd_products(like, batch: int, chunks: int, chunk: int, heads: int, head_dim: int, groups: int, state: int) -> None:
    """The SSD kernel's batched products on `like`'s device (meta: shapes only), for the FLOP
    counter: per chunk C B^T per group (chunk x state x chunk), the masked scores times x per head
    (chunk x chunk x head_dim), the chunk state B^T x (head_dim x chunk x state) and its read-out
    C h (chunk x state x head_dim)."""
    n = batch * chunks
    _batched_products(like, n * groups, [(chunk, state, chunk)])
    _batched_products(like, n * heads, [(chunk, chunk, head_dim), (head_dim, chunk, state), (chunk, state, head_dim)])


def _batched_products(like, count: int, shapes) -> None:
    """`count` (rows x inner) @ (inner x cols) products per shape, run on `like`'s device (meta:
    shapes only) so that the FLOP counter counts them."""
    import torch

    for rows, inner, cols in shapes:
        torch.bmm(like.new_empty(count, rows, inner), like.new_empty(count, inner, cols))


@functools.cache  # one autograd Function class, not one per traced layer
def _kernel_ssd_class():
    import torch

    class KernelSSD(torch.autograd.Function):
        """mamba_ssm's chunked scan: its saved tensors and products (module docstring); meta only."""

        @staticmethod
        def forward(ctx, x, dt, A, B, C, D, dt_bias, chunk):
            batch, seq, heads, head_dim = x.shape
            chunks = -(-seq // chunk)
            ctx.shape = (batch, chunks, chunk, heads, head_dim, B.shape[2], B.shape[3])
            ssd_products(x, *ctx.shape)
            dA_cumsum = x.new_empty(batch, heads, chunks, chunk, dtype=torch.float32)
            out = x.new_empty(x.shape)
            ctx.save_for_backward(out, x, dt, dA_cumsum, A, B, C, D, dt_bias)
            return out

        @staticmethod
        def backward(ctx, grad):
            for _ in range(2):  # each product's two operands take a gradient
                ssd_products(grad, *ctx.shape)
            _, x, dt, _, A, B, C, D, dt_bias = ctx.saved_tensors
            return tuple(None if t is None else t.new_empty(t.shape) for t in (x, dt, A, B, C, D, dt_bias)) + (None,)

    return KernelSSD


def kernel_ssd(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
               dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """transformers' `mamba2_chunk_scan` signature, run as `KernelSSD`."""
    import torch

    out = _kernel_ssd_class().apply(hidden_states, dt, A, B, C, D, dt_bias, chunk_size)
    if return_final_states:
        batch, _, heads, head_dim = hidden_states.shape
        return out, hidden_states.new_empty(batch, heads, head_dim, B.shape[-1], dtype=torch.float32)
    return out


def gdn_products(like, batch: int, chunks: int, heads: int, key_dim: int, value_dim: int,
                 recompute: bool = False) -> None:
    """Gated DeltaNet's chunk products on `like`'s device (meta: shapes only), for the FLOP counter,
    per value head and chunk of C positions: the system (k beta) k^T (C x K x C), its triangular
    inverse (counted as one C x C x C product), w = A (k beta g) and u = A (v beta), the state's read
    w h and update k^T v (K x V each, per position), the output's q h and (q k^T) v. `recompute`:
    only what the kernel's backward reruns (w, u and the states)."""
    c = GDN_CHUNK
    shapes = [(c, c, key_dim), (c, c, value_dim), (c, key_dim, value_dim), (key_dim, c, value_dim)]
    if not recompute:
        shapes += [(c, key_dim, c), (c, c, c), (c, key_dim, value_dim), (c, key_dim, c), (c, c, value_dim)]
    _batched_products(like, batch * chunks * heads, shapes)


@functools.cache  # one autograd Function class, not one per traced layer
def _kernel_gdn_class():
    import torch

    class KernelGDN(torch.autograd.Function):
        """flash-linear-attention's chunked gated delta rule: its saved tensors and products (module
        docstring); meta only."""

        @staticmethod
        def forward(ctx, q, k, v, g, beta, l2norm):
            batch, seq, _, key_dim = k.shape
            heads, value_dim = v.shape[-2:]
            ctx.shape = (batch, -(-seq // GDN_CHUNK), heads, key_dim, value_dim)
            gdn_products(v, *ctx.shape)
            rstd = [t.new_empty(t.shape[:-1], dtype=torch.float32) if l2norm else None for t in (q, k)]
            q_kept, k_kept = (t.new_empty(t.shape) if l2norm else t for t in (q, k))
            g_sum = g.new_empty(g.shape, dtype=torch.float32)
            A = k.new_empty(batch, seq, heads, GDN_CHUNK)
            ctx.save_for_backward(q_kept, rstd[0], k_kept, rstd[1], v, g_sum, beta, A)
            return v.new_empty(batch, seq, heads, value_dim)

        @staticmethod
        def backward(ctx, grad):
            gdn_products(grad, *ctx.shape, recompute=True)
            for _ in range(2):  # each product's two operands take a gradient
                gdn_products(grad, *ctx.shape)
            q, _, k, _, v, g, beta, _ = ctx.saved_tensors
            return tuple(t.new_empty(t.shape) for t in (q, k, v, g, beta)) + (None,)

    return KernelGDN


def kernel_gdn(query, key, value, g, beta, chunk_size=GDN_CHUNK, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' `torch_chunk_gated_delta_rule` signature, run as `KernelGDN`: (output, final
    state or None). `chunk_size` is not read: flash-linear-attention's kernels chunk by 64."""
    import torch

    out = _kernel_gdn_class().apply(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    if not output_final_state:
        return out, None
    batch, heads, key_dim, value_dim = key.shape[0], value.shape[-2], key.shape[-1], value.shape[-1]
    return out, value.new_empty(batch, heads, key_dim, value_dim, dtype=torch.float32)


# (modules, the function they name, its kernel-shaped stand-in)
_KERNELS = ((SCAN_MODULES, "mamba_selective_scan", kernel_scan), (SSD_MODULES, "mamba2_chunk_scan", kernel_ssd),
            (GDN_MODULES, "torch_chunk_gated_delta_rule", kernel_gdn))


@contextlib.contextmanager
def scan_as_kernel(device):
    """Within: on the meta device, transformers' Mamba scans run as `kernel_scan`, its Mamba-2
    scans as `kernel_ssd` and its gated DeltaNet as `kernel_gdn` (else untouched). Only modules
    already imported are patched: the model built before imported its own. transformers' notice
    that its kernels fall back to "much slower" reference code is held back: nothing runs on the
    meta device, and the fallbacks it names are priced as the kernels."""
    import logging
    import sys

    import torch

    if torch.device(device).type != "meta":
        yield
        return
    notices = logging.getLogger(KERNEL_NOTICE_LOGGER)
    level = notices.level
    notices.setLevel(logging.ERROR)
    patched = []
    for names, function, kernel in _KERNELS:
        for name in names:
            module = sys.modules.get(name)
            if module is not None and hasattr(module, function):
                patched.append((module, function, getattr(module, function)))
                setattr(module, function, kernel)
    try:
        yield
    finally:
        for module, function, original in patched:
            setattr(module, function, original)
        notices.setLevel(level)

