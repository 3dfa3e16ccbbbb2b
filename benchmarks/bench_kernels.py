"""meshplan's kernel-level prices against published kernel benchmarks (checks; nothing fitted).

    python benchmarks/bench_kernels.py

1. GEMMs (`planner.costing.gemm.gemm_time_s`): FBGEMM's H100 500 W measurements of three large
   GEMMs in bf16 and with a rowwise-scaled fp8 kernel, against `h100-96g-500w`: whether the
   capped part's peak (a datasheet midpoint) and the fitted efficiencies give the rate a GEMM
   really reaches there.
2. FP8 Linears (`planner.costing.fp8.linear_seconds`): torchao's compiled Float8Linear under its
   rowwise recipe at Llama 3 70B's TP 8 shard shapes, bf16 and fp8 seconds and the speed-up.
   These are the Linears of torchtitan's Llama 3.1 70B FSDP 32 x TP 8 rows, so they say whether
   the FP8/BF16 speed-up meshplan predicts for those runs errs in the Linears or outside them.

The sources and their conditions are in `published_kernel_runs.py`.
"""
from __future__ import annotations

import sys
from functools import lru_cache

from published_kernel_runs import gemm_rows, linear_rows

from meshplan.planner.costing import fp8, gemm
from meshplan.planner.costing.hardware import load_cluster

cluster_of = lru_cache(maxsize=None)(load_cluster)  # each row names its profile; read each once


def predicted_tflops(row) -> float:
    """meshplan's rate for one published GEMM row, TFLOP/s."""
    seconds = gemm.gemm_time_s(row.m, row.n, row.k, cluster_of(row.profile), row.dtype)
    return 2.0 * row.m * row.n * row.k / seconds / 1e12


def predicted_linear(row) -> tuple[float, float]:
    """meshplan's (bf16, fp8) seconds for one published Linear row."""
    return fp8.linear_seconds(row.m, row.k, row.n, cluster_of(row.profile), row.recipe, row.compiled)


def report_gemms() -> None:
    rows = gemm_rows()
    print(f"== GEMMs: {rows[0].source} ==")
    print(f"  {'m x n x k':<22} {'dtype':<6} {'profile':<15} {'published':>10} {'meshplan':>10} {'error':>8}")
    for row in rows:
        predicted = predicted_tflops(row)
        print(f"  {f'{row.m}x{row.n}x{row.k}':<22} {row.dtype:<6} {row.profile:<15} {row.published_tflops:>10.0f} "
              f"{predicted:>10.0f} {predicted / row.published_tflops - 1:>+8.1%}")


def report_linears() -> None:
    rows = linear_rows()
    print(f"\n== FP8 Linears: {rows[0].source} ==")
    print(f"  {'Linear':<10} {'(m, k, n)':<20} {'bf16 ms pub/model':>18} {'fp8 ms pub/model':>18} "
          f"{'speed-up pub/model':>19}")
    seconds = [predicted_linear(row) for row in rows]
    for row, (bf16_s, fp8_s) in zip(rows, seconds):
        print(f"  {row.name:<10} {str((row.m, row.k, row.n)):<20} {row.bf16_s * 1e3:>8.3f} / {bf16_s * 1e3:<7.3f} "
              f"{row.fp8_s * 1e3:>8.3f} / {fp8_s * 1e3:<7.3f} {row.published_speedup:>8.2f}x / {bf16_s / fp8_s:.2f}x")
    published = sum(r.bf16_s for r in rows) / sum(r.fp8_s for r in rows)
    predicted = sum(b for b, _ in seconds) / sum(f for _, f in seconds)
    print(f"  the four together (one block's Linears, wq/wk/wv and w1/w3 fused): published {published:.2f}x, "
          f"meshplan {predicted:.2f}x")


def main() -> int:
    report_gemms()
    report_linears()
    return 0


if __name__ == "__main__":
    sys.exit(main())
