"""The routed experts' compute on one rank: grouped GEMMs at the per-expert token count, and the
memory-bound token shuffles around them (permutation before the experts, unpermutation after).

Notation as `expert_parallel`'s: per rank and micro-batch, T tokens of the rank's tp group
(mbs * s, / cp under CP), k = top_k, E experts, h hidden, f one routed expert's width, F the
busiest rank's load factor (`expert_parallel.load_factor`: the imbalance, the capacity or the
padding).

- Tokens per expert. A stage's ranks share the expert work of their tokens evenly under
  balanced routing: a rank computes T k / tp routed copies' worth, times F on the busiest rank.
  It holds G = E / ep experts, each split etp ways (its width f / etp), so every one of its G
  experts runs its GEMMs on
      m = T k F etp ep / (tp E)    rows
  (at the default etp = tp: T k F ep / E, the balanced T k / E copies per expert of the ep
  ranks' tokens). Small per-expert batches run far below the dense peak: m = 512 rows of a
  (512 x 4096) @ (4096 x 1536) product is a 6.4 GFLOP GEMM.
- Grouped GEMM time. Each of the G experts' Linears (gate and up: h -> f / etp, column; down:
  f / etp -> h, row; `expert_linear_shapes`) is priced one GEMM at a time by `costing.gemm`'s
  shape rule at m rows: forward, the input gradient and the weight gradient, each with its tile
  and wave quantisation, its memory roofline and its fixed per-GEMM cost (the size curve's
  `matmul_half_efficiency_flops`), then times G. Transformer Engine's GroupedLinear (behind
  Megatron-Core's TEGroupedMLP) runs the experts' GEMMs as separate cuBLAS GEMMs over a few streams
  (AMD's Primus MoE guide: "each expert is a separate GEMM; naive multi-stream execution leaves
  scheduling gaps"), so every expert pays its own tile padding, tail wave and fixed cost: G
  experts at m rows cost G times one expert, not one GEMM of G m rows. A grouped kernel pays
  little more at large m: DeepGEMM's m-grouped contiguous kernel (8 groups of m = 4096, N 4096,
  K 7168) runs at 1288 TFLOP/s where its plain GEMM of one group's shape runs at 1304
  (deepseek-ai/DeepGEMM README, 2025, H800 FP8), 1.2% apart. At small m it pays a tail per group
  beyond its shapes: the same README's masked-layout rows split 1024 rows into 1, 2 and 4 groups
  (N 4096, K 7168: 1233, 1040, 932 TFLOP/s; N 7168, K 2048: 925, 916, 815), and what they take
  beyond this shape rule's G GEMMs, less the one-group row's own excess, pooled over the 8 extra
  groups, is 2.0 us per extra group on the shipped h100-sxm profile (`grouped_gemm_tail_s`, derived
  from the table when first asked). Each grouped call (one per expert Linear forward, two backward: the input
  and the weight gradients) pays it for each of its G - 1 extra groups, on GPU profiles (a
  profile without SMs, the CPU, has no tiles). Plus one `kernel_overhead_s` per pass (forward
  one, backward two: `compute_time_s`'s launch convention).
- Shuffles (`shuffle_bytes`): the permutation regroups the received copies by local expert and
  the unpermutation puts the experts' outputs back in token order; each reads and writes every
  copy the rank computes (m G rows of h elements): 4 m G h b bytes per pass, at the device's
  achieved bandwidth, the same again in backward (their gradients).
- Router (`router_times_s`): its gate Linear (h -> E, replicated over tp) runs on the tokens the
  rank holds, T / tp under sequence parallelism, else all T (each tp rank routes the same
  tokens), priced by the shape rule: forward (rows x h) @ (h x E), the input and the weight
  gradients backward. E is narrow: at Qwen3-235B's shapes (h 4096, E 128, 2048 rows) the
  product is memory-bound on its hidden states. Its fp32 softmax and top-k stay with the dense part's memory-bound kernels (the bytes
  they keep, `expert_parallel.dense_part`); `expert_parallel.dense_part(layer, info)` leaves the
  gate's FLOPs out so they are not priced twice.

- fp8 (`fp8.experts_in_fp8`: engines that run routed experts in fp8, Megatron-Core's TEGroupedMLP):
  the same grouped GEMMs at the fp8 rate and the recipe's scale blocks, plus the recipe's casts
  (`expert_cast_values`, `fp8_grouped_times_s`): each expert quantises its own tensors, as
  Transformer Engine's GroupedLinear does (one quantizer per GEMM).

A model that names no `hidden` or `expert_ffn` keeps the FLOP-only curve: the expert FLOPs as
G n_g equal GEMMs on `device_time.compute_time_s`. Otherwise the rows follow from the expert
FLOPs and the shapes (`routed_copies`), so the shapes always reproduce the FLOPs.
"""
from __future__ import annotations

from functools import cache

from meshplan.planner.contracts.engine_rules import wgrad_accumulator_bytes
from meshplan.planner.costing import fp8, gemm
from meshplan.planner.costing.device_time import compute_time_s, memory_time_s

# GEMMs per routed expert when the layer's TP split names none: a SwiGLU (gate, up, down).
SWIGLU_GEMMS = 3
# Reads and writes of every computed copy per pass: the permutation and the unpermutation.
SHUFFLE_PASSES = 4
# DeepGEMM README (2025), "Grouped GEMMs for MoE models (masked layout)", H800 FP8: 1024 rows split
# into 1, 2 and 4 groups, as (groups, rows per group, N, K, TFLOP/s).
DEEPGEMM_MASKED = ((1, 1024, 4096, 7168, 1233), (2, 512, 4096, 7168, 1040), (4, 256, 4096, 7168, 932),
                   (1, 1024, 7168, 2048, 925), (2, 512, 7168, 2048, 916), (4, 256, 7168, 2048, 815))
# The profile whose shape rule the table is read against: H800 is H100 SXM's compute.
TAIL_PROFILE = "h100-sxm"


@cache
def grouped_gemm_tail_s() -> float:
    """Per extra group of a grouped GEMM call: what DeepGEMM's masked kernel takes beyond the
    shape rule's G GEMMs (fp8 on `TAIL_PROFILE`), less the one-group row's own excess, pooled
    over the table's extra groups (module docstring). Derived from the table and the shipped
    profile, so a refit of the profile's efficiencies moves it with them."""
    from meshplan.planner.costing.hardware import load_cluster

    cluster = load_cluster(TAIL_PROFILE)

    def excess_s(groups, rows, n, k, tflops):
        return 2 * groups * rows * n * k / (tflops * 1e12) - groups * gemm.gemm_time_s(rows, n, k, cluster, "fp8")
    total_s = extra = 0.0
    for n in sorted({row[2] for row in DEEPGEMM_MASKED}):
        rows_of_n = sorted((row for row in DEEPGEMM_MASKED if row[2] == n), key=lambda row: row[0])
        base_s = excess_s(*rows_of_n[0])
        for row in rows_of_n[1:]:
            total_s += excess_s(*row) - base_s
            extra += row[0] - 1
    return total_s / extra


def is_expert_linear(name: str) -> bool:
    """A Linear of the routed experts (`moe.experts.gate`), as the TP split names it."""
    return "experts" in name.split(".")


def expert_gemms(layer) -> int:
    """GEMMs each routed expert runs per forward (its Linears in the layer's TP split)."""
    names = layer.tp_split.column_linears + layer.tp_split.row_linears
    return sum(map(is_expert_linear, names)) or SWIGLU_GEMMS


def expert_linear_shapes(layer, info) -> tuple[tuple[int, int, bool], ...]:
    """(in, out, column) of one routed expert's Linears before expert TP (gate and up h -> f,
    column; down f -> h, row), from the layer's TP split; () when the model names no widths."""
    split = layer.tp_split
    columns = sum(map(is_expert_linear, split.column_linears))
    rows = sum(map(is_expert_linear, split.row_linears))
    if not columns and not rows:
        columns, rows = SWIGLU_GEMMS - 1, 1
    hidden, width = info.hidden, info.expert_ffn
    if not hidden or not width:
        return ()
    return ((hidden, width, True),) * columns + ((width, hidden, False),) * rows


def routed_copies(layer, info) -> float:
    """Routed copies per sample (s k), from the expert FLOPs and the experts' shapes; 0 when the
    shapes are unknown."""
    shapes = expert_linear_shapes(layer, info)
    per_copy = 2.0 * sum(i * o for i, o, _ in shapes)
    return layer.expert_fwd_flops / per_copy if per_copy else 0.0


def local_experts(config, info) -> int:
    """G: the experts one rank holds (E / ep), each split etp ways."""
    return max(1, info.num_experts // config.ep)


def tokens_per_expert(layer, config, info, load: float) -> float:
    """m: rows each of the rank's experts runs per micro-batch, T k F etp ep / (tp E) (module
    docstring); `load` is F."""
    copies = routed_copies(layer, info) * config.rank_microbatch / config.tp * load
    return copies * config.expert_tp / local_experts(config, info)


def grouped_gemm_times_s(layer, config, cluster, info, dtype: str, load: float,
                         scale_block: int = 0) -> tuple[float, float] | None:
    """(forward, backward) seconds of the rank's G experts' GEMMs at m rows each, by shape
    (`gemm.linear_times_s`, times G), plus each grouped call's tail for its G - 1 extra groups
    (`grouped_gemm_tail_s`, GPU profiles) and `kernel_overhead_s` per pass (backward two); None
    when the model names no expert shapes."""
    shapes = expert_linear_shapes(layer, info)
    if not shapes or not layer.expert_fwd_flops:
        return None
    rows = tokens_per_expert(layer, config, info, load)
    if rows <= 0:
        return None
    groups = local_experts(config, info)
    fwd_s, bwd_s = gemm.linear_times_s(shapes, rows, config.expert_tp, cluster, dtype, scale_block,
                                       wgrad_accumulate_bytes=wgrad_accumulator_bytes(config))
    tail_s = grouped_gemm_tail_s() * (groups - 1) * len(shapes) if cluster.device.num_sms > 0 else 0.0
    overhead_s = cluster.device.kernel_overhead_s
    return groups * fwd_s + tail_s + overhead_s, groups * bwd_s + 2 * tail_s + 2 * overhead_s


def expert_cast_values(layer, config, info, load: float) -> tuple[float, float, float]:
    """(input, weight, output-gradient) values the rank's G experts quantise per micro-batch under
    fp8 (`fp8.cast_values`' counts for grouped Linears): each expert's fc1 input once (m x h, shared
    by its gate and up: Megatron-Core's fc1 is one GroupedLinear of width 2f), the down projection's
    input (m x f / etp), every weight (/ etp), and each Linear's output gradient on m rows."""
    shapes = expert_linear_shapes(layer, info)
    rows, groups, etp = tokens_per_expert(layer, config, info, load), local_experts(config, info), config.expert_tp
    first_column = next((i for i, _, column in shapes if column), 0)
    inputs = rows * (first_column + sum(i / etp for i, _, column in shapes if not column))
    weights = sum(i * o for i, o, _ in shapes) / etp
    grads = fp8.output_gradient_values(shapes, rows, etp)
    return groups * inputs, groups * weights, groups * grads


def fp8_grouped_times_s(layer, config, cluster, info, load: float) -> tuple[float, float] | None:
    """(forward, backward) seconds of the rank's experts in fp8 (`fp8.experts_in_fp8`): their grouped
    GEMMs by shape at the fp8 rate (`grouped_gemm_times_s`, the recipe's scale blocks read beside
    the operands) plus the recipe's casts of `expert_cast_values` at the achieved bandwidth, weights
    once per step where the engine caches them (`fp8.weight_cast_share`); None when the model names
    no expert shapes. Their saved inputs are already fp8 in that engine's memory recipe
    (`megatron_activations.routed_expert_terms`: Transformer Engine keeps the fp8 copies), which
    this time now agrees with."""
    chosen = fp8.recipe_of(config)
    grouped = grouped_gemm_times_s(layer, config, cluster, info, "fp8", load, chosen.scale_block)
    if grouped is None:
        return None
    cast_fwd_s, cast_bwd_s = fp8.cast_times_s(chosen, expert_cast_values(layer, config, info, load),
                                              fp8.weight_cast_share(config), cluster)
    return grouped[0] + cast_fwd_s, grouped[1] + cast_bwd_s


def flop_curve_times_s(fwd_flops: float, bwd_flops: float, num_gemms: int, cluster, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of expert FLOPs as `num_gemms` equal GEMMs on the efficiency
    curve (backward twice as many, in two launches): layers whose shapes are unknown."""
    return (compute_time_s(fwd_flops, num_gemms, cluster, dtype),
            compute_time_s(bwd_flops, 2 * num_gemms, cluster, dtype, num_launches=2))


def shuffle_bytes(layer, config, info, load: float, elem_bytes: float) -> float:
    """Bytes one pass's permutation and unpermutation move: every computed copy read and written
    by each, 4 m G h b (`SHUFFLE_PASSES`)."""
    rows = tokens_per_expert(layer, config, info, load) * local_experts(config, info)
    return SHUFFLE_PASSES * rows * info.hidden * elem_bytes


def shuffle_time_s(layer, config, cluster, info, load: float, elem_bytes: float) -> float:
    """Seconds of one pass's token shuffles at the device's achieved bandwidth."""
    return memory_time_s(shuffle_bytes(layer, config, info, load, elem_bytes), cluster)


def router_flops(layer, info) -> float:
    """Forward FLOPs per sample of the gate Linear (h -> E) on the s = s k / k tokens; 0 when the
    experts' shapes are unknown."""
    copies = routed_copies(layer, info)
    if not copies or not info.top_k or not info.num_experts:
        return 0.0
    return 2.0 * copies / info.top_k * info.hidden * info.num_experts


def router_times_s(layer, config, cluster, info, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of the gate Linear on the rank's tokens (T / tp under SP, else
    T), by shape; (0, 0) when the shapes are unknown."""
    flops = router_flops(layer, info)
    if not flops:
        return 0.0, 0.0
    tokens = routed_copies(layer, info) / info.top_k * config.rank_microbatch / (config.tp if config.sp else 1)
    return gemm.linear_times_s(((info.hidden, info.num_experts, True),), tokens, 1, cluster, dtype)
