"""State-space (Mamba) mixers of Hugging Face models on the meta device: the selective scan as its
fused kernel runs it.

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
bytes above as every elementwise operation's is. Mamba-2's chunked scan is matmuls in transformers'
torch path and is traced as it is.
"""
from __future__ import annotations

import contextlib

# transformers' modeling modules whose `mamba_selective_scan` is the looped reference scan
SCAN_MODULES = tuple(f"transformers.models.{name}.modeling_{name}" for name in ("mamba", "falcon_mamba", "jamba",
                                                                                  "zamba"))
# positions per chunk of mamba_ssm's selective-scan kernel (its checkpointed states)
KERNEL_CHUNK = 2048


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


@contextlib.contextmanager
def scan_as_kernel(device):
    """Within: on the meta device, transformers' Mamba scans run as `kernel_scan` (else untouched).
    Only modules already imported are patched: the model built before imported its own."""
    import sys

    import torch

    if torch.device(device).type != "meta":
        yield
        return
    patched = []
    for name in SCAN_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "mamba_selective_scan"):
            patched.append((module, module.mamba_selective_scan))
            module.mamba_selective_scan = kernel_scan
    try:
        yield
    finally:
        for module, original in patched:
            module.mamba_selective_scan = original

