"""Published kernel measurements meshplan's GEMM and FP8 Linear prices are checked against.

Nothing here tunes a constant: each row is a check of the cost model's kernel level
(`planner.costing.gemm`, `planner.costing.fp8`), printed by `bench_kernels.py` and held by
tests/planner/costing/test_kernel_checks.py. Two sources, each a kernel benchmark on H100:

- FBGEMM's fp8 GEMM benchmark (github.com/pytorch/FBGEMM pull request 2546, "Add fp8 row/block-wise
  scaled GEMMs", 2024-04-29), headed "H100 500W": one (M, N, K) GEMM's TFLOP/s in bf16 (torch.mm)
  and with FBGEMM's rowwise-scaled fp8 Triton kernel ("fp8 row gemm only": the GEMM alone, the
  operands already quantised). Its script reads a shape as (m, n, k), the input m x k and the weight
  n x k, and times each GEMM replayed in a CUDA graph (triton's `do_bench_cudagraph`, its default).
  A measured GEMM rate on the part that `h100-96g-500w` describes, whose peak is otherwise the
  midpoint of two datasheets.
- torchao's Float8Linear benchmark in github.com/pytorch/ao pull request 2185 ("remove workaround for
  slow rowwise cutlass gemm", 2025-05-08), its table "tensorwise w/ rescale": a compiled Linear's
  forward and backward in bf16 and under torchao's rowwise recipe as it shipped (the gradient GEMMs
  on the tensorwise cuBLAS kernel, rescaled after), casts included, at Llama 3 70B's TP 8 shard
  shapes on 16,384 tokens (wq/wk/wv fused, w1/w3 fused). The PR names the GPU as H100 only: priced
  as `h100-sxm`. Its `use_fast_accum=True` rows (the forward's setting in torchao's recipe).
"""
from __future__ import annotations

from dataclasses import dataclass

FBGEMM_2546 = ("FBGEMM pull request 2546 (github.com/pytorch/FBGEMM/pull/2546), 'Add fp8 row/block-wise scaled "
               "GEMMs': bf16 and 'fp8 row gemm only' TFLOP/s, headed 'H100 500W'")
TORCHAO_2185 = ("torchao pull request 2185 (github.com/pytorch/ao/pull/2185): Float8Linear forward + backward, "
                "compiled, 'tensorwise w/ rescale' table, use_fast_accum=True rows, on H100")


@dataclass(frozen=True)
class GemmRow:
    """One GEMM C[m, n] = A[m, k] B[k, n] as a benchmark timed it: TFLOP/s in `dtype` on `profile`."""

    source: str
    profile: str
    m: int
    n: int
    k: int
    dtype: str
    published_tflops: float

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k) <= 0 or self.published_tflops <= 0:
            raise ValueError(f"GEMM {self.m}x{self.n}x{self.k}: dimensions and TFLOP/s must be positive, "
                             f"got {self.published_tflops}")


@dataclass(frozen=True)
class LinearRow:
    """One Linear (input m x k, weight k x n), forward and backward, in bf16 and in fp8 under
    `recipe`: seconds as a benchmark timed them on `profile`."""

    source: str
    profile: str
    name: str
    m: int
    k: int
    n: int
    recipe: str
    compiled: bool
    bf16_s: float
    fp8_s: float

    def __post_init__(self) -> None:
        if min(self.m, self.k, self.n) <= 0 or min(self.bf16_s, self.fp8_s) <= 0:
            raise ValueError(f"Linear {self.name} ({self.m}, {self.k}, {self.n}): dimensions and seconds must be "
                             f"positive, got {self.bf16_s}, {self.fp8_s}")

    @property
    def published_speedup(self) -> float:
        return self.bf16_s / self.fp8_s


def gemm_rows() -> list[GemmRow]:
    """FBGEMM's three shapes as its script reads them (m, n, k: the input m x k, the weight n x k, the
    output m x n), bf16 and fp8."""
    figures = (((8192, 8192, 8192), 585.23, 1125.51), ((65536, 8192, 7168), 575.12, 1082.75),
               ((65536, 3584, 8192), 546.31, 1141.38))
    rows = []
    for (m, n, k), bf16, fp8 in figures:
        rows.append(GemmRow(FBGEMM_2546, "h100-96g-500w", m, n, k, "bf16", bf16))
        rows.append(GemmRow(FBGEMM_2546, "h100-96g-500w", m, n, k, "fp8", fp8))
    return rows


def linear_rows() -> list[LinearRow]:
    """torchao's four Linears at Llama 3 70B's TP 8 shards (its `shape` is (M, K, N)), seconds."""
    figures = (("attn.wqkv", (16384, 8192, 1280), 0.001954, 0.001757),
               ("attn.w0", (16384, 1024, 8192), 0.001701, 0.001193),
               ("ffn.w13", (16384, 8192, 7168), 0.009871, 0.005707),
               ("ffn.w2", (16384, 3584, 8192), 0.005192, 0.003034))
    return [LinearRow(TORCHAO_2185, "h100-sxm", name, m, k, n, "rowwise", True, bf16_s, fp8_s)
            for name, (m, k, n), bf16_s, fp8_s in figures]
