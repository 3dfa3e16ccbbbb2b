"""GEMM time from its shape: (m, n, k, dtype, device) -> seconds.

A GEMM C[m, n] = A[m, k] B[k, n] of 2 m n k FLOPs takes the longer of
- its compute: the FLOPs at the dtype's peak x `matmul_efficiency` (the fitted whole-layer
  fraction large GEMMs reach), x the size curve f / (f + `matmul_half_efficiency_flops`) of its
  own FLOPs f (fixed per-GEMM costs: launch, prologue, epilogue), x its wave efficiency;
- its memory traffic: A, B and C once each (m k + k n + m n elements) at the achieved bandwidth
  (thin shards and small micro-batches become memory-bound, the roofline); an fp8 GEMM reads
  1-byte operands (and MXFP8's block scales) and writes bf16, as torchao's float8 roofline
  counts it (torchao/testing/training/roofline_utils.py, get_individual_gemm_time_sympy), at
  the fp8 peak x `fp8_matmul_efficiency` on the size curve with f_half scaled by fp8 / bf16 peak.

Wave efficiency (tile and wave quantisation): cuBLAS/CUTLASS cut C into output tiles, one per
SM at a time; a GEMM runs ceil(tiles / SMs) waves, and a partly filled tile or last wave costs as
much as a full one. With tiles Tm x Tn over `num_sms` SMs, the useful fraction is
m n / (ceil(m/Tm) ceil(n/Tn) Tm Tn) x tiles / (waves x SMs). cuBLAS's heuristics choose among
tile shapes per problem, so the best of `TILE_SHAPES` is taken (the tile and wave quantisation of
NVIDIA's "Matrix Multiplication Background User's Guide", whose A100 examples use 256x128 and
128x128 tiles; CUTLASS's Hopper BF16 kernels default to 128x256). A profile with
`num_sms = 0` (the CPU) has no tiles and no roofline: its curve was measured as a whole.

By width: a profile may carry `matmul_width_efficiency`, a factor on the size curve by the GEMM's
narrowest dimension (`width_factor`). `meshplan calibrate` fits it on CPU, where a GEMM of a
narrow hidden size or a thin TP shard runs below what its FLOPs alone predict (the vector units'
blocking wastes lanes on short rows; no tile rule describes MKL's or oneDNN's kernels), from a sweep
of shapes across widths (`calibration.fits.fit_width_efficiency`). GPU profiles leave it empty:
their tiles and waves are modelled.

The ceiling: the largest BF16 matmul a tuned sweep finds reaches 85.9% of A100 SXM's peak and
80.1% of H100 SXM's (ml-engineering's "Maximum Achievable Matmul FLOPS" table, mamf-finder over
shapes, CUDA 12.1); `MAX_ACHIEVABLE_MATMUL_FRACTION` keeps those figures, and a profile's fitted
`matmul_efficiency` (whole layers, with their norms' and launches' losses) must stay below them
(a test holds it). The same table's later edition measures BF16 and FP8 on one torch build per
device (`MAMF_BF16_FP8`): FP8 reaches a smaller share of its doubled peak, and that ratio carries
the fitted BF16 efficiency over to `fp8_matmul_efficiency` (`benchmarks/fit_efficiency.py`); B200's and
GB200's rows carry H100's fit over to those parts, each dtype by its own ceiling over H100's BF16 one.

A transformer block's Linears are priced one GEMM at a time from the model's shapes
(`block_linear_shapes`): forward (tokens x in -> out), the input gradient (tokens x out -> in) and
the weight gradient (in x tokens -> out) per Linear, each on the rank's tokens and TP shard. Where
the engine fuses gradient accumulation into the weight-gradient GEMM (Megatron-Core's `main_grad`,
`engine_rules.WGRAD_ACCUMULATING_ENGINES`), that GEMM reads and writes the fp32 (or bf16) buffer, 8
(or 4) bytes per weight each micro-batch instead of writing 2: on few rows (a routed expert's
tokens, a small micro-batch) it becomes memory-bound: about rows / 4 FLOPs a byte in fp32.
Times are cached per shape and device: the search prices the same shapes many times.
"""
from __future__ import annotations

import math
from functools import lru_cache

from meshplan.planner.contracts.cluster import ClusterProfile, DeviceProfile
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp8": 1}
TILE_SHAPES = ((128, 256), (256, 128), (128, 128))
# ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table".
MAX_ACHIEVABLE_MATMUL_FRACTION = {"A100 SXM": 0.859, "GH200": 0.830, "H100 SXM": 0.801, "MI300X": 0.601}
# The table at ml-engineering commit 744d01e (2026-08-22), whose BF16 and FP8 (float8_e4m3fn) rows
# for a device were measured with one torch build: (BF16, FP8) MAMF over the dense peak. H100 SXM:
# 794.5 of 989 and 1402.6 of 1979 TFLOP/s, torch 2.7.0+cu126; B200 SXM: 1745.0 of 2250 and 3432.5
# of 4500, torch 2.7.1+cu128; GB200: 1822.0 of 2500 and 3615.6 of 5000, torch 2.10.0.dev20250916+cu130.
MAMF_BF16_FP8 = {"H100 SXM": (0.803, 0.709), "B200 SXM": (0.776, 0.763), "GB200 SXM": (0.729, 0.723)}


def wave_efficiency(m: int, n: int, num_sms: int) -> float:
    """Useful fraction of the output tiles' SM time over the waves they run in (best tile).

    A dimension below a tile's shrinks the tile to it (rounded up to the MMA granularity of 16,
    as cuBLAS's narrow kernels do), and a GEMM of fewer tiles than SMs pays its padding only:
    cuBLAS splits K (split-K / stream-K) to occupy the idle SMs."""
    if num_sms <= 0 or m <= 0 or n <= 0:
        return 1.0
    best = 0.0
    for tile_m, tile_n in TILE_SHAPES:
        tile_m, tile_n = min(tile_m, 16 * math.ceil(m / 16)), min(tile_n, 16 * math.ceil(n / 16))
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
        waves = 1.0 if tiles < num_sms else tiles / (math.ceil(tiles / num_sms) * num_sms)
        best = max(best, (m * n) / (tiles * tile_m * tile_n) * waves)
    return best


def width_table(device: DeviceProfile) -> tuple[tuple[int, float], ...]:
    """The profile's `matmul_width_efficiency` as ((width, factor), ...) by ascending width."""
    return tuple(sorted((int(width), float(factor)) for width, factor in device.matmul_width_efficiency.items()))


def width_factor(narrowest: float, table: tuple[tuple[int, float], ...]) -> float:
    """The factor on the size curve of a GEMM whose narrowest dimension is `narrowest`: linear in
    log2 of the width between the table's widths, its end values beyond them; 1 without a table."""
    if not table:
        return 1.0
    if narrowest <= table[0][0]:
        return table[0][1]
    for (low, low_factor), (high, high_factor) in zip(table, table[1:]):
        if narrowest <= high:
            share = math.log2(narrowest / low) / math.log2(high / low)
            return low_factor + share * (high_factor - low_factor)
    return table[-1][1]


def fp8_half_efficiency_flops(device: DeviceProfile) -> float:
    """The size curve's f_half for fp8 GEMMs: bf16's scaled by the peak ratio fp8 / bf16 (the same
    fixed time per GEMM is worth that many more FLOPs)."""
    return device.matmul_half_efficiency_flops * device.peak_flops("fp8") / device.peak_flops("bf16")


def _device_key(device: DeviceProfile, dtype: str) -> tuple:
    if dtype == "fp8":  # the fp8 recipes' own efficiency (`planner.costing.fp8`)
        efficiency, half = device.fp8_matmul_efficiency, fp8_half_efficiency_flops(device)
    else:
        efficiency, half = device.matmul_efficiency, device.matmul_half_efficiency_flops
    return (device.peak_flops(dtype), efficiency, half, device.num_sms,
            device.memory_bw_bytes_per_s * device.memory_efficiency, width_table(device))


@lru_cache(maxsize=65536)
def _gemm_time_s(m: int, n: int, k: int, in_bytes: float, out_bytes: float, key: tuple) -> float:
    peak, efficiency, half_flops, num_sms, bandwidth, widths = key
    flops = 2.0 * m * n * k
    if flops <= 0:
        return 0.0
    achieved = peak * efficiency * flops / (flops + half_flops) * wave_efficiency(m, n, num_sms) * width_factor(
        min(m, n, k), widths)
    compute_s = flops / achieved
    if num_sms <= 0:
        return compute_s
    return max(compute_s, ((m * k + k * n) * in_bytes + m * n * out_bytes) / bandwidth)


def gemm_time_s(m: float, n: float, k: float, cluster: ClusterProfile, dtype: str, scale_block: int = 0,
                accumulate_bytes: float = 0.0) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM in `dtype` on the cluster's device (no launch
    overhead: the layer's kernel sequence pays that once). fp8 GEMMs write a bf16 output and
    take `fp8_matmul_efficiency`; `scale_block`: values per 1-byte scale read beside each fp8
    operand (MXFP8's 32; 0: one scale per tensor or row, nothing to read); `accumulate_bytes`:
    the GEMM adds its product into an existing C of that many bytes per element (beta = 1), which
    it reads and writes, instead of writing C once in its output dtype (0)."""
    dims = tuple(max(1, round(d)) for d in (m, n, k))
    in_bytes = DTYPE_BYTES.get(dtype, 2) * (1 + 1 / scale_block if scale_block else 1)
    out_bytes = DTYPE_BYTES["bf16"] if dtype == "fp8" else DTYPE_BYTES.get(dtype, 2)
    if accumulate_bytes:
        out_bytes = 2.0 * accumulate_bytes
    return _gemm_time_s(*dims, in_bytes, out_bytes, _device_key(cluster.device, dtype))


def block_linear_shapes(layer: LayerProfile, info: ModelInfo, seq: int) -> tuple[tuple[int, int, bool], ...]:
    """(in, out, column) of a transformer block's Linears, before TP (column: split on its
    output, else on its input), from the model's shapes: its token mixer's (attention's, or a
    Mamba-2 mixer's in_proj and out_proj, or none), then its dense MLP (a hybrid's layer may have
    none) or, for a MoE block's dense part (`expert_parallel.dense_part`), its shared experts'
    SwiGLU (none without shared experts); () when the shapes do not reproduce the layer's Linear
    FLOPs (traced layers, a MoE block with its routed experts: those stay on the FLOP-only curve).
    A Mamba-2 mixer's chunked scan (`ModelInfo.mamba_scan_fwd_flops`) is no Linear."""
    if layer.kind != "block" or layer.tp_split.kind != "block" or layer.expert_params or not info.hidden \
            or not info.num_heads or not seq:
        return ()
    split, h = layer.tp_split, info.hidden
    mixer = _mixer_shapes(info, split.mixer)
    ffn = info.ffn or split.mlp_width
    column_mlp = 2 if split.gated_mlp(info.family) else 1
    mlps = [() if split.mlp == "none" else ((h, ffn, True),) * column_mlp + ((ffn, h, False),)]
    if info.num_experts:  # a MoE block's dense part: the shared experts' SwiGLU, if any
        shared = info.shared_ffn
        mlps.append(((h, shared, True),) * 2 + ((shared, h, False),) if shared else ())
    linear_fwd = layer.fwd_flops - layer.attn_fwd_flops - layer.conv_fwd_flops  # a Mamba mixer's depthwise conv
    if split.mixer == "mamba2":
        linear_fwd -= info.mamba_scan_fwd_flops(seq)
    for mlp in mlps:
        shapes = mixer + mlp
        counted = 2 * seq * sum(i * o for i, o, _ in shapes)
        if linear_fwd and abs(counted - linear_fwd) <= 0.01 * linear_fwd:
            return shapes
    return ()


def _mixer_shapes(info: ModelInfo, mixer: str) -> tuple[tuple[int, int, bool], ...]:
    """The token mixer's Linears: attention's q, k, v and o; a Mamba-2 mixer's in_proj and out_proj."""
    if mixer == "none":
        return ()
    if mixer == "mamba2":
        return (info.hidden, info.mamba_in_proj_width, True), (info.mamba_heads * info.mamba_head_dim, info.hidden,
                                                                False)
    head_dim = info.attention_head_dim
    q_dim, kv_dim = info.num_heads * head_dim, (info.num_kv_heads or info.num_heads) * head_dim
    return ((info.hidden, q_dim, True), (info.hidden, kv_dim, True), (info.hidden, kv_dim, True),
            (q_dim, info.hidden, False))


def linear_gemms_s(shape: tuple[int, int, bool], tokens: float, tp: int, cluster: ClusterProfile, dtype: str,
                   scale_block: int = 0, pieces: tuple[int, int] = (1, 1),
                   wgrad_accumulate_bytes: float = 0.0) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of one Linear `shape` (in, out, column)
    on `tokens` rows of one rank, split `tp` ways (a column Linear on its output, a row Linear on
    its input); `pieces`: how many equal row chunks its forward and its input-gradient GEMM run as
    (torch's micro-pipelined TP, `overlap.micro_pipeline_pieces`); `wgrad_accumulate_bytes`: the
    weight gradient accumulates into a buffer of that many bytes per element
    (`engine_rules.wgrad_accumulator_bytes`: Megatron-Core's `main_grad`), 0: written once."""
    in_dim, out_dim, column = shape
    in_local, out_local = (in_dim, out_dim / tp) if column else (in_dim / tp, out_dim)
    fwd_n, dgrad_n = pieces
    return (fwd_n * gemm_time_s(tokens / fwd_n, out_local, in_local, cluster, dtype, scale_block),
            dgrad_n * gemm_time_s(tokens / dgrad_n, in_local, out_local, cluster, dtype, scale_block),
            gemm_time_s(in_local, out_local, tokens, cluster, dtype, scale_block, wgrad_accumulate_bytes))


def linear_times_s(shapes, tokens: float, tp: int, cluster: ClusterProfile, dtype: str,
                   scale_block: int = 0, pieces=None, wgrad_accumulate_bytes: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of the Linears `shapes` on `tokens` rows of one rank
    (`linear_gemms_s` each; `pieces`, per Linear, or None: one GEMM each)."""
    fwd_s = bwd_s = 0.0
    for index, shape in enumerate(shapes):
        fwd, dgrad, wgrad = linear_gemms_s(shape, tokens, tp, cluster, dtype, scale_block,
                                           pieces[index] if pieces else (1, 1), wgrad_accumulate_bytes)
        fwd_s, bwd_s = fwd_s + fwd, bwd_s + dgrad + wgrad
    return fwd_s, bwd_s


def linear_flops(shapes, tokens: float, tp: int) -> float:
    """Forward FLOPs of the Linears `shapes` on `tokens` rows of one rank (backward: twice)."""
    return 2.0 * tokens * sum(i * o for i, o, _ in shapes) / tp
