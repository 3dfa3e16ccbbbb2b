"""Fused attention kernels' speed by name, sequence length, head dimension and device.

A device profile's `attention_efficiency` is FlashAttention-2's (torch SDPA's flash backend)
fraction of the bf16 peak on long sequences at head dimension 128, forward and backward, in
meshplan's FLOP convention (backward counted as twice the forward; the kernels' own papers count
2.5 times, so a published backward speed b is worth 0.8 b here). Every other kernel is that
times its speed ratio to FlashAttention-2 on the device's architecture, times

- a sequence ramp s / (s + s_half), normalised to 1 at 16K: short sequences leave SMs idle and
  pay the per-tile prologue; s_half is fitted (by hand, least squares by eye on the published
  bars) to each kernel's own curve at head dimension 128, 512 to 16K tokens;
- a head-dimension factor: at 64 the kernels reach `head_dim_64` of their 128 speed (linear in
  between, 1 above 128).

Grouped-query attention: the published benchmarks show no separate effect, so none is applied.

Sources (H100 80GB SXM5, BF16): Shah et al. 2024, "FlashAttention-3" (arXiv:2407.08608),
Figures 5-6: forward causal at head dim 128 reaches 335 (FlashAttention-2), 616 (FlashAttention-3)
and 539 TFLOP/s (cuDNN) at 16K, backward 322, 561 and 516; at head dim 64 FlashAttention-2 runs
forward 324 against 370 and backward 264 against 291 (2K), FlashAttention-3 497 against 648 and
422 against 501, cuDNN 413 against 595 and 395 against 465. Forward F at f and backward 2.5 F at b
give 3.5 / (1/f + 2.5/b): 326 (FA2), 576 (FA3), 522 TFLOP/s (cuDNN), the ratios below.
llm-foundry's Triton kernel (flash_attn_triton.py, FlashAttention-1's algorithm with a bias for
ALiBi): its docstring says "overall Triton forward + backward is slightly slower than CUDA
forward + backward" (FlashAttention-1), and Dao 2023 ("FlashAttention-2", arXiv:2307.08691)
reports FlashAttention-2 "around 2x" FlashAttention-1: half of FlashAttention-2's speed.

torch's own kernels, measured (`benchmarks/gpu_check.py` on one H200 SXM, torch 2.11 with CUDA 13.0,
stored in benchmarks/data/h200_gpu_check.json: causal forward + backward, 32K tokens a call, 2048
channels of heads, 1K-16K tokens, head dims 64 and 128; s_half by least squares on the log of the
speed over its 16K speed, both head dims): SDPA's flash backend reaches 269 TFLOP/s at 16K and head
dim 128, 0.96 of the FlashAttention-2 figure above, on a slower ramp (s_half 1020: 145 TFLOP/s at 1K)
and 0.886 of that speed at head dim 64; its memory-efficient backend (xformers' cutlass kernel)
0.446 of the flash backend at 16K (0.43 of FlashAttention-2), s_half 480, head dim 64 at 0.763. An
H200 is H100 silicon with faster memory, and attention at these shapes is compute-bound, so these
stand for Hopper; off Hopper the two are costed as before they were measured (the flash backend as
FlashAttention-2, the memory-efficient one as FlashAttention-1's generation). Pre-Hopper and newer devices have no FA3 and
no separate figure for cuDNN: cuDNN is costed as FlashAttention-2 there, FlashAttention-3 refused.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.contracts.attention import canonical_attention, is_fused
from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.errors import MeshplanError

REFERENCE_SEQ = 16384
REFERENCE_HEAD_DIM = 128


@dataclass(frozen=True)
class KernelSpeed:
    """One fused kernel: its speed over FlashAttention-2's, its sequence ramp and head-dimension-64
    factor, all on Hopper. Off Hopper: `elsewhere` names the kernel it is costed as ("": itself,
    None: it does not run there)."""

    ratio: float
    seq_half: float
    head_dim_64: float
    elsewhere: str | None = ""

    def __post_init__(self):
        if not self.ratio > 0 or not self.seq_half > 0 or not 0 < self.head_dim_64 <= 1:
            raise ValueError(f"kernel speed needs ratio > 0, seq_half > 0, head_dim_64 in (0, 1], got {self}")


FLASH2 = KernelSpeed(ratio=1.0, seq_half=320.0, head_dim_64=0.89)
# torch SDPA's flash backend as measured on an H200 (the docstring's figures): 268.8 TFLOP/s at
# 16K, head dim 128, over FlashAttention-2's 0.282 x 989 = 278.9.
SDPA_FLASH = KernelSpeed(ratio=268.8 / 278.9, seq_half=1020.0, head_dim_64=0.886, elsewhere="flash2")
KERNEL_SPEEDS = {
    "flash2": FLASH2,
    "sdpa-flash": SDPA_FLASH,
    "flash3": KernelSpeed(ratio=576 / 326, seq_half=400.0, head_dim_64=0.80, elsewhere=None),
    "cudnn": KernelSpeed(ratio=522 / 326, seq_half=330.0, head_dim_64=0.77, elsewhere="flash2"),
    # FlashAttention-1's generation: half of FlashAttention-2, on its ramp and head-dim factor
    "triton-alibi": KernelSpeed(ratio=0.5, seq_half=320.0, head_dim_64=0.89),
    "sdpa-mem-efficient": KernelSpeed(ratio=119.9 / 278.9, seq_half=480.0, head_dim_64=0.763, elsewhere="triton-alibi"),
}
# The kernel each engine runs when its user names none: Megatron-Core with Transformer Engine picks
# cuDNN fused attention on Hopper (TE >= 1.2, "Select FusedAttention on sm90"; elsewhere
# FlashAttention-2, which `kernel_speed` costs it as); torchtitan, DeepSpeed's Hugging Face models
# and meshplan's executor call torch SDPA; llm-foundry's MPT defaults to attn_impl 'flash', the
# flash-attn package (llmfoundry/models/utils/config_defaults.py), though its 2023 benchmark tables
# ran 'triton' (those runs name their kernel).
ENGINE_DEFAULT_ATTENTION = {"meshplan": "flash", "megatron": "cudnn", "torchtitan": "flash",
                            "deepspeed": "flash", "llm-foundry": "flash2", "generic": "flash"}


def engine_attention(engine: str | None, attention: str | None,
                     cluster: ClusterProfile | None = None) -> tuple[str, str]:
    """(kernel, note): `attention` where the user named one (no note), else the kernel `engine`
    runs by default (`ENGINE_DEFAULT_ATTENTION`) and, unless that is meshplan's own, the line that
    says which kernel the prediction took and, on `cluster`, what it is costed as where that is
    another kernel (`costed_kernel`: cuDNN has no published figure off Hopper)."""
    if attention is not None:
        return attention, ""
    engine = engine or "meshplan"
    kernel = ENGINE_DEFAULT_ATTENTION.get(engine, "flash")
    if engine == "meshplan":
        return kernel, ""
    costed = costed_kernel(kernel, cluster) if cluster is not None else canonical_attention(kernel)
    on_device = f", costed as {costed} on this device" if costed != canonical_attention(kernel) else ""
    return kernel, f"attention: {kernel}, {engine}'s default kernel{on_device} (--attention to change it)"


def costed_kernel(attention: str, cluster: ClusterProfile) -> str:
    """The kernel whose speed `attention` takes on `cluster`: its own on Hopper or where it has no
    stand-in, else its `KernelSpeed.elsewhere`; MeshplanError when the device cannot run it."""
    name = canonical_attention(attention)
    elsewhere = KERNEL_SPEEDS[name].elsewhere
    if cluster.device.architecture == "hopper" or elsewhere == "":
        return name
    if elsewhere is None:
        raise MeshplanError(f"--attention {attention}: FlashAttention-3 runs on Hopper GPUs only; profile "
                            f"{cluster.name!r} is {cluster.device.architecture or 'not a GPU'} (use flash2 or cudnn)")
    return elsewhere


def kernel_speed(attention: str, cluster: ClusterProfile) -> KernelSpeed:
    """The fused kernel's speed entry on `cluster` (`costed_kernel`)."""
    return KERNEL_SPEEDS[costed_kernel(attention, cluster)]


def shape_factor(speed: KernelSpeed, seq: int, head_dim: int) -> float:
    """The kernel's speed at (`seq`, `head_dim`) over its speed at 16K tokens and head dim 128."""
    ramp = 1.0
    if seq > 0:
        ramp = (seq / (seq + speed.seq_half)) / (REFERENCE_SEQ / (REFERENCE_SEQ + speed.seq_half))
    width = 1.0
    if 0 < head_dim < REFERENCE_HEAD_DIM:
        share = max(0.0, (head_dim - 64) / (REFERENCE_HEAD_DIM - 64))
        width = speed.head_dim_64 + (1 - speed.head_dim_64) * share
    return ramp * width


def plateau_from_measured(efficiency: float, seqs, head_dim: int, architecture: str) -> float:
    """The profile's `attention_efficiency` (FlashAttention-2 at 16K tokens, head dim 128) from
    torch SDPA's flash kernel timed at `seqs` and `head_dim` on a GPU of `architecture`
    (`calibrate`): the measured figure over that kernel's mean shape factor there and its ratio to
    FlashAttention-2, capped at 1."""
    speed = SDPA_FLASH if architecture == "hopper" else KERNEL_SPEEDS[SDPA_FLASH.elsewhere]
    factors = [shape_factor(speed, seq, head_dim) for seq in seqs]
    if efficiency <= 0 or not factors:
        return efficiency
    return min(1.0, efficiency * len(factors) / sum(factors) / speed.ratio)


def attention_efficiency(attention: str, cluster: ClusterProfile, seq: int, head_dim: int) -> float:
    """Fraction of the bf16 peak a fused kernel reaches at `seq` tokens and `head_dim` (meshplan's
    FLOP convention); 0 for math attention or a device without `attention_efficiency`."""
    base = cluster.device.attention_efficiency
    if base <= 0 or not is_fused(attention):
        return 0.0
    if not cluster.device.architecture:  # no GPU generation: a measured figure, as timed
        return base
    speed = kernel_speed(attention, cluster)
    return min(1.0, base * speed.ratio * shape_factor(speed, seq, head_dim))
