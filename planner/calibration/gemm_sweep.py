"""The CPU's GEMMs by width, as `meshplan calibrate` times them: the shapes of small models' Linears
(narrow hidden sizes, thin tensor-parallel shards), from which `fits.fit_width_efficiency` fits
the profile's `matmul_width_efficiency` (`costing.gemm.width_factor`).

Per width w: a w -> w Linear, an MLP's w -> 4w up-projection and its 4w -> w down-projection (or a
4-way shard of a 4w hidden's square one), each on `SWEEP_TOKENS` rows, so w is the narrowest
dimension of all three.
"""
from __future__ import annotations

SWEEP_WIDTHS = (16, 32, 64, 128, 256, 512)
SWEEP_TOKENS = 512
# FLOPs per timed sample: enough repeats of a small GEMM that the timer's resolution does not matter
SAMPLE_FLOPS = 5e7


def sweep_shapes() -> list[tuple[int, int, int]]:
    """(m, n, k) of the swept GEMMs: (m x k) @ (k x n), m the tokens."""
    return [(SWEEP_TOKENS, n, k) for w in SWEEP_WIDTHS for n, k in ((w, w), (4 * w, w), (w, 4 * w))]


def measure_gemm_widths(torch, device, timer, reps: int) -> list[tuple[int, int, int, float]]:
    """[(m, n, k, seconds of one GEMM)] per `sweep_shapes` entry, in fp32 (the CPU's training dtype),
    timed as `runner` times the square matmuls (this process's CPU time per thread)."""
    out = []
    for m, n, k in sweep_shapes():
        a = torch.randn(m, k, device=device)
        b = torch.randn(k, n, device=device)
        inner = max(1, int(SAMPLE_FLOPS // (2 * m * n * k)))
        seconds = timer(lambda: [torch.mm(a, b) for _ in range(inner)], reps, cpu_time=True) / inner
        out.append((m, n, k, seconds))
    return out
