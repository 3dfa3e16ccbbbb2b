"""What `calibrate` times of one device's compute, at shapes sized for the device it runs on.

A CPU process trains small models (hidden 256, a few hundred tokens), so its shapes are small; a
GPU's must be large enough to reach the regime a training step runs in: square GEMMs of 1-8K (a
1K GEMM on an H100 is launch- and wave-bound), a GPT block of hidden 2048 on 2-16K tokens, and
flash attention with 16 heads of 128 at 1-8K tokens (`BenchShapes`, `CPU_SHAPES`, `GPU_SHAPES`).

`measure_compute` times, in `COMPUTE_ROUNDS` alternating rounds: the matmul sweep, the GPT block
at each traffic shape (forward + backward), one tiny block's forward (the per-layer dispatch
cost), 3x3 convolutions and causal SDPA attention. Each figure is the fastest of its rounds on GPUs
and their median on CPU (as `Timer` takes its samples). The elementwise factor is fitted to the
block's time less the GEMMs and the overhead, so all of them must see the same machine: a slow
spell of a shared host during one of them only reads as a wrong factor.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from meshplan.planner.calibration.host import relative_spread

COMPUTE_ROUNDS = 3


@dataclass(frozen=True)
class BenchShapes:
    """The shapes one backend's compute is timed at."""

    dtype: str                      # the training dtype: fp32 on CPU, bf16 on GPUs
    matmul_n: tuple[int, ...]       # square GEMM sizes (`fits.fit_matmul`)
    quick_matmul_n: tuple[int, ...]
    block_spec: str                 # the GPT block of the elementwise-traffic fit
    traffic_shapes: tuple[tuple[int, int], ...]  # its (batch, seq)
    attention_seqs: tuple[int, ...]
    attention_batch: int
    attention_heads: int
    attention_head_dim: int
    conv_batch_scale: int           # x the batches of `CONV_SHAPES`

    def __post_init__(self):
        if not self.matmul_n or not self.traffic_shapes or not self.attention_seqs:
            raise ValueError(f"calibration shapes need matmul sizes, traffic shapes and attention lengths, got {self}")


CPU_SHAPES = BenchShapes(
    dtype="fp32", matmul_n=(64, 128, 256, 512, 1024), quick_matmul_n=(64, 128, 256, 512),
    block_spec="gpt:layers=1,hidden=256,heads=4,vocab=1024",
    # the shapes of the small models meshplan trains on CPU, and one twice as long
    traffic_shapes=((1, 128), (2, 128), (4, 128), (1, 256)),
    attention_seqs=(256, 1024, 2048), attention_batch=1, attention_heads=4, attention_head_dim=64,
    conv_batch_scale=1)
GPU_SHAPES = BenchShapes(
    dtype="bf16", matmul_n=(1024, 2048, 4096, 6144, 8192), quick_matmul_n=(1024, 4096, 8192),
    block_spec="gpt:layers=1,hidden=2048,heads=16,vocab=1024",
    traffic_shapes=((1, 2048), (2, 2048), (4, 2048), (2, 4096)),
    attention_seqs=(1024, 4096, 8192), attention_batch=4, attention_heads=16, attention_head_dim=128,
    conv_batch_scale=16)
TRAFFIC_SHAPES = CPU_SHAPES.traffic_shapes  # the CPU's: the fixed-cost fits reuse its first sample


def bench_shapes(cuda: bool) -> BenchShapes:
    return GPU_SHAPES if cuda else CPU_SHAPES


# Cycles a second of the spin kernel that holds the GPU while the host enqueues (`fill_queue`): no
# GPU clocks above 2 GHz, so the spin lasts at least as long as asked.
SPIN_CYCLES_PER_S = 2e9


def fill_queue(torch, host_s: float) -> None:
    """Keep the GPU busy (a spin kernel) for longer than the host takes to enqueue what follows,
    so that CUDA events around it time the kernels and not Python's launches: on a slow host an
    eager `torch.mm` takes longer to dispatch (about 20 us on one H200 machine) than a 1K GEMM
    takes to run, and timings of back-to-back calls then read the host's rate."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int((1.5 * host_s + 2e-4) * SPIN_CYCLES_PER_S))


class Timer:
    """Fastest of `reps` timings of `fn()`: the least disturbed by other work on a shared machine,
    which is what the device itself can do. GPUs: CUDA events; compute (`cpu_time=True`) behind
    `fill_queue`, so the kernels' own time. Collectives wait on peers, so they take wall time. CPU compute (`cpu_time=True`): this process's CPU seconds per thread, which
    preemption by other processes does not inflate, and their median: what is left varies with
    the core's clock and the caches the other processes share, as it does while training, whose
    step time meshplan reports as a median (the fastest sample read 5-15% fast)."""

    def __init__(self, cuda: bool, threads: int = 1):
        self.cuda = cuda
        self.threads = threads

    def __call__(self, fn, reps: int, cpu_time: bool = False) -> float:
        import torch

        fn()  # warm-up (allocations, algorithm selection, connection setup)
        host_s = 0.0
        if self.cuda and cpu_time:  # how long the host takes to enqueue fn's kernels
            torch.cuda.synchronize()
            begin = time.perf_counter()
            fn()
            host_s = time.perf_counter() - begin
            torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if host_s:
                    fill_queue(torch, host_s)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            elif cpu_time:
                begin = time.process_time()
                fn()
                samples.append((time.process_time() - begin) / self.threads)
            else:
                begin = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - begin)
        return statistics.median(samples) if cpu_time and not self.cuda else min(samples)


def _torch_dtype(torch, shapes: BenchShapes):
    return torch.bfloat16 if shapes.dtype == "bf16" else torch.float32


def measure_matmul(torch, device, matmul_n, reps: int, timer, cuda) -> list[tuple[float, float]]:
    """[(FLOPs, seconds)] of one n x n x n matmul per size, in the training dtype."""
    dtype = _torch_dtype(torch, bench_shapes(cuda))
    points = []
    for n in matmul_n:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        inner = max(1, int(2e8 // (2 * n**3)) if not cuda else 10)  # ~0.2 GFLOP per sample on CPU
        seconds = timer(lambda: [torch.mm(a, b) for _ in range(inner)], reps, cpu_time=True) / inner
        points.append((2.0 * n**3, seconds))
    return points


def measure_copy(torch, device, copy_bytes: int, reps: int, timer) -> float:
    src = torch.ones(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src), max(2, reps // 2), cpu_time=True)
    return 2.0 * copy_bytes / seconds  # read + write


def _measure_block(torch, device, timer) -> float:
    """Forward of one tiny transformer block: all dispatch and launch, almost no FLOPs."""
    from meshplan.planner.models.transformer import Block, TransformerConfig

    block = Block(TransformerConfig("gpt", 1, 64, 4, 128)).to(device)
    x = torch.randn(1, 8, 64, device=device)
    with torch.no_grad():
        return timer(lambda: block(x), 20, cpu_time=True)


def measure_compute(torch, device, matmul_n, reps: int, timer, cuda) -> dict:
    """The matmul sweep, the block shapes, the tiny block's dispatch overhead, convolutions and
    attention, in `COMPUTE_ROUNDS` alternating rounds (the module's docstring says why)."""
    rounds = [(measure_matmul(torch, device, matmul_n, reps, timer, cuda), _time_block_shapes(torch, device, timer, cuda),
               _measure_block(torch, device, timer), _measure_conv(torch, device, timer, cuda),
               _measure_attention(torch, device, timer, cuda))
              for _ in range(COMPUTE_ROUNDS)]
    pick = min if cuda else statistics.median
    matmul = [(flops, pick(r[0][i][1] for r in rounds)) for i, (flops, _) in enumerate(rounds[0][0])]
    shapes = bench_shapes(cuda)
    block_s = [pick(r[1][i] for r in rounds) for i in range(len(shapes.traffic_shapes))]
    conv = [(fwd, bwd, pick(r[3][i][2] for r in rounds)) for i, (fwd, bwd, _) in enumerate(rounds[0][3])]
    attention = [(flops, pick(r[4][i][1] for r in rounds)) for i, (flops, _) in enumerate(rounds[0][4])]
    spread = statistics.median(relative_spread([r[0][i][1] for r in rounds]) for i in range(len(matmul)))
    return {"matmul": matmul, "compute_spread": spread, "block_overhead_s": pick(r[2] for r in rounds), "conv": conv,
            "attention": attention, "attention_seqs": list(shapes.attention_seqs),
            "attention_head_dim": shapes.attention_head_dim,
            "block": [{**figures, "fwd_bwd_s": seconds} for figures, seconds in zip(block_figures(cuda), block_s)]}


# (batch, channels, height = width) of the 3x3 convolutions (padding 1, no bias) timed forward +
# backward for `conv_efficiency`: a mid-sized image stage and a deeper, smaller one.
CONV_SHAPES = ((4, 48, 48), (4, 96, 24))


def _measure_conv(torch, device, timer, cuda) -> list[tuple[float, float, float]]:
    """[(forward FLOPs, backward FLOPs, seconds of forward + backward)] per `CONV_SHAPES` entry."""
    shapes = bench_shapes(cuda)
    out = []
    for batch, channels, size in CONV_SHAPES:
        batch = batch * shapes.conv_batch_scale
        conv = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False).to(
            device=device, dtype=_torch_dtype(torch, shapes))
        x = torch.randn(batch, channels, size, size, device=device, dtype=_torch_dtype(torch, shapes),
                        requires_grad=True)
        fwd_flops = 2.0 * batch * channels * channels * 9 * size * size
        seconds = timer(lambda: conv(x).sum().backward(), 5, cpu_time=True)
        out.append((fwd_flops, 2.0 * fwd_flops, seconds))  # backward: input and weight gradients
    return out


def _measure_attention(torch, device, timer, cuda) -> list[tuple[float, float]]:
    """[(FLOPs, seconds)] of causal SDPA forward + backward per sequence length: the FLOPs a
    flash kernel runs (the causal half of QK^T and x V, 2x that backward)."""
    import torch.nn.functional as F

    shapes = bench_shapes(cuda)
    out = []
    for seq in shapes.attention_seqs:
        q, k, v = (torch.randn(shapes.attention_batch, shapes.attention_heads, seq, shapes.attention_head_dim,
                               device=device, dtype=_torch_dtype(torch, shapes), requires_grad=True)
                   for _ in range(3))
        fwd_flops = 4.0 * shapes.attention_batch * shapes.attention_heads * seq * seq * shapes.attention_head_dim / 2
        seconds = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), 3,
                        cpu_time=True)
        out.append((3.0 * fwd_flops, seconds))
    return out


def _time_block_shapes(torch, device, timer, cuda) -> list[float]:
    """Forward + backward seconds of the shapes' GPT block at each traffic shape."""
    from meshplan.planner.models.registry import parse_spec
    from meshplan.planner.models.transformer import Block

    shapes = bench_shapes(cuda)
    config = parse_spec(shapes.block_spec, max(seq for _, seq in shapes.traffic_shapes))
    block = Block(config).to(device=device, dtype=_torch_dtype(torch, shapes))
    out = []
    for batch, seq in shapes.traffic_shapes:
        x = torch.randn(batch, seq, config.hidden, device=device, dtype=_torch_dtype(torch, shapes), requires_grad=True)
        out.append(timer(lambda: block(x).sum().backward(), 5, cpu_time=True))
    return out


def block_figures(cuda: bool) -> list[dict[str, float]]:
    """The forward and backward FLOPs and activation bytes the profiler gives that block at each
    shape, so that the fitted factor explains exactly what the cost model leaves out for a
    profiled layer."""
    from meshplan.planner.costing.device_time import causal_skipped_flops
    from meshplan.planner.costing.gemm import block_linear_shapes
    from meshplan.planner.profiling.profiler import profile

    shapes = bench_shapes(cuda)
    figures = []
    for batch, seq in shapes.traffic_shapes:
        graph = profile(shapes.block_spec, seq, dtype=shapes.dtype, cache=False)
        layer = next(layer for layer in graph.layers if layer.kind == "block")
        skipped = causal_skipped_flops(layer, graph.attention)  # the flash kernel skips the masked half
        figures.append({"fwd_flops": float((layer.fwd_flops - skipped) * batch),
                        "bwd_flops": float((layer.bwd_flops - 2 * skipped) * batch),
                        "attn_fwd_flops": float((layer.attn_fwd_flops - skipped) * batch),
                        "saved_bytes": float(layer.activation_bytes * batch), "tokens": float(batch * seq),
                        # its Linears by shape, as `compute_time` prices a zoo block's (`gemm.linear_times_s`)
                        "linear_shapes": [list(shape) for shape in block_linear_shapes(layer, graph.info, seq)]})
    return figures
