"""FP8 Linears: every rule the cost model applies under `precision="fp8"`, once, per scaling recipe.

`fp8` runs a transformer block's dense Linears (q, k, v, o, the MLP's up, gate, down) in fp8 and
everything else as bf16-mixed: attention's core, norms and elementwise work, the embedding, the
head (torchtitan's default `filter_fqns = ["output"]`), and MoE routed experts (grouped GEMMs)
except under the engines that run those in fp8 too (`experts_in_fp8`: Megatron-Core, whose
TEGroupedMLP is Transformer Engine's GroupedLinear inside the layer's fp8_autocast; priced by
`moe_compute.fp8_grouped_times_s`).
`config.fp8_recipe` names how each GEMM operand is scaled (`RECIPES`; `contracts.config`
resolves the engine's default). `layer_cost` and `compute_time` read these functions, so the
ILP and the simulator charge the same thing.

Compute, per micro-batch on one rank:
- each fp8 GEMM by its shape (`gemm.gemm_time_s` at the profile's fp8 peak x
  `fp8_matmul_efficiency`, the size curve, wave quantisation and the roofline: fp8 operands,
  a bf16 output, MXFP8's E8M0 scales read beside them): forward, input gradient and weight
  gradient of every Linear (`gemm.block_linear_shapes`); a block whose shapes are not known
  (MoE blocks, traced models) puts its Linears' FLOPs on the fp8 size curve (`fp8_gemm_time_s`).
  No recipe slows the GEMM itself: torchao's roofline prices its tensorwise, rowwise and MXFP8
  GEMMs at one fp8 rate (torchao/testing/training/roofline_utils.py, get_gemm_time_sympy);
- the casts, memory-bound at the achieved bandwidth: each Linear's input, its weight and its
  output gradient is quantised once per micro-batch into the two layouts Hopper's fp8 GEMMs
  need (K-major for one GEMM, transposed for the other), at the recipe's bytes per value
  (`Fp8Recipe`). Forward pays the inputs' and weights' casts, backward the output gradients'.
  Megatron-LM's Transformer Engine Linears quantise a weight on the first micro-batch of a step
  and reuse it (`is_first_microbatch`, megatron/core/extensions/transformer_engine.py), so under
  `--engine megatron` a weight's cast is paid once per step (`weight_cast_share`). Under
  torch.compile (torchtitan's, `ParallelConfig.torch_compile`) an input's and an output
  gradient's cast lose their first read to the kernel before them (`cast_times_s`), unless an
  all-gather produced the tensor (`collective_cast_values`). One cast of a region's input serves
  its column Linears, as Transformer Engine's fused linear_qkv and linear_fc1 and torch.compile
  make it; torchtitan's separate Linears run eagerly cast it once each, forward and backward
  (`fp8_eager`);
- torchao's rowwise gradient GEMMs: one more bf16 pass over each output (`gradient_rescale_s`);
- FSDP2's float8 all-gather: a weight cast on the rank's fp32 shard as it is gathered, then copied
  into its transposed layout (`gathered_weight_cast_bytes`);
- torchtitan's Float8 TP plan (tensorwise): the block's sequence-parallel all-gathers move fp8
  and their casts run on the sequence shard (`fp8_tp_gather`; `communication.tp_comm_parts_s`),
  writing one layout; the weight gradients copy the gathered tensors into the other (`fp8_layouts`).

Memory per rank (`fp8_memory`): model states as bf16-mixed (fp32 masters and Adam moments, the
bf16 compute copy); the fp8 Linears' saved inputs in fp8, their fp8 weight copies and scales, and
ZeRO 1-3's parameter all-gathers in fp8 where the engine gathers them so
(`Fp8Recipe.fp8_gather_engines`: torchtitan's `enable_fsdp_float8_all_gather`, tensorwise only;
Megatron-LM's `--fp8-param-gather`).

Which Linears run in fp8: a block's, less those `config.fp8_filter` leaves in bf16 (torchao's
per-module filter, `fp8_filter`); those run as bf16 Linears by shape and cast nothing.

Not modelled: Transformer Engine's fp8 TP all-gathers (Megatron), fp8 attention, the
amax history's memory. Not executed: `meshplan train` refuses fp8 plans.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import FP8_RECIPES, ParallelConfig
from meshplan.planner.contracts.engine_rules import runs_compiled, wgrad_accumulator_bytes
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import gemm
from meshplan.planner.costing.fp8_eager import activation_cast_times_s, casts_eagerly, column_casts_per_region
from meshplan.planner.costing.fp8_filter import Fp8Linears, fp8_linears, input_regions
from meshplan.planner.costing.fp8_layouts import gathered_transpose_times_s
from meshplan.planner.costing.device_time import (ATTENTION_BMMS_PER_BLOCK, DTYPE_BYTES, gemm_and_attention_times_s,
                                                  infer_seq, memory_time_s)

FP8_BYTES = 1.0
BF16_BYTES = 2.0
# One fp32 scale per cast tensor of a Linear: input, weight, output gradient.
FP8_SCALE_BYTES_PER_LINEAR = 3 * 4.0
# MXFP8: one E8M0 (1-byte) scale per 32 consecutive values (Transformer Engine's MXFP8 docs).
MX_BLOCK = 32


@dataclass(frozen=True)
class Fp8Recipe:
    """How one fp8 recipe quantises a Linear's GEMM operands, in memory traffic per value.

    `activation_cast_bytes`: bytes read and written per value of a Linear's input or output
    gradient (bf16 in) to produce both fp8 layouts; `weight_cast_bytes`: the same per weight
    value. `architectures`: the GPU generations whose tensor cores run its GEMMs (() any with an
    fp8 peak). `fp8_gather_engines`: the engines whose parameter all-gathers move its fp8 weights.
    `scale_block`: values per scale read beside each GEMM operand (0: one scale per tensor or row).
    `fp8_tp_gather_engines`: the engines whose sequence-parallel all-gathers move the fp8 casts
    (the cast then runs on the sequence shard, `fp8_tp_gather`). `rescaled_gradient_gemms`: the
    input- and weight-gradient GEMMs write an unscaled bf16 output that one more kernel rescales
    (`gradient_rescale_s`)."""

    name: str
    activation_cast_bytes: float
    weight_cast_bytes: float
    fp8_gather_engines: tuple[str, ...]
    architectures: tuple[str, ...] = ()
    scale_block: int = 0
    fp8_tp_gather_engines: tuple[str, ...] = ()
    rescaled_gradient_gemms: bool = False

    def __post_init__(self):
        if self.name not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe name must be one of {', '.join(FP8_RECIPES)}, got {self.name!r}")
        if not (self.activation_cast_bytes > 0 and self.weight_cast_bytes > 0):
            raise ValueError(f"{self.name}: cast bytes per value must be positive, got "
                             f"{self.activation_cast_bytes}, {self.weight_cast_bytes}")


B, F = BF16_BYTES, FP8_BYTES
RECIPES = {recipe.name: recipe for recipe in (
    # torchao tensorwise (roofline_utils.get_tensor_memory_traffic_ovhd_s, unfused): an amax pass
    # (read bf16), then one kernel reads bf16 and writes both fp8 layouts; a weight is cast
    # once per layout (fwd, bwd), each reading bf16. Float8 all-gather: torchtitan (FSDP2's
    # `enable_fsdp_float8_all_gather`), meshplan's pricing of it, Megatron's --fp8-param-gather.
    # torchtitan's TP plan for it (Float8ColwiseParallel, Float8RowwiseParallel and
    # PrepareFloat8ModuleInput from torchao/float8/float8_tensor_parallel.py, chosen in
    # models/llama3/parallelize_llama.py for tensorwise only) casts before its all-gathers.
    Fp8Recipe("tensorwise", B + (B + 2 * F), B + 2 * (B + F), ("meshplan", "generic", "torchtitan", "megatron"),
              fp8_tp_gather_engines=("torchtitan",)),
    # torchao rowwise (same source): one kernel writes the row-scaled fp8 copy and a bf16
    # transpose, a second quantises that transpose along the other axis (a row's scale cannot
    # serve the column-scaled GEMM); a weight pays a separate bf16 transpose (read + write).
    # torchao gathers rowwise weights in bf16 (its float8 README: "rowwise with bfloat16 all-gather").
    # Its gradient GEMMs run without fast accumulation (Float8LinearConfig's gemm_config_grad_input
    # and gemm_config_grad_weight), where torchao calls the tensorwise cuBLAS kernel and rescales
    # the output after it (torchao/float8/float8_ops.py, addmm_float8_unwrapped: "the rowwise
    # CUTLASS-based kernel is so slow without fast-accum"): one more pass over each gradient.
    Fp8Recipe("rowwise", (B + F + B) + (B + F), (B + F) + 2 * B + (B + F), (), rescaled_gradient_gemms=True),
    # Transformer Engine's DelayedScaling: the scale comes from the amax history, so the cast
    # needs no amax pass (it records this step's amax as it casts): one cast-transpose kernel
    # reads bf16 once and writes both layouts. Megatron's --fp8-param-gather gathers them in fp8.
    Fp8Recipe("delayed", B + 2 * F, B + 2 * F, ("megatron",)),
    # MXFP8 (Transformer Engine's MXFP8BlockScaling, Blackwell's block-scaled tensor cores): each
    # 32-value block scales itself, so one kernel reads bf16 once and writes both layouts with one
    # E8M0 scale per block each; the GEMMs read the scales beside the operands.
    Fp8Recipe("mxfp8", B + 2 * F * (1 + 1 / MX_BLOCK), B + 2 * F * (1 + 1 / MX_BLOCK), ("megatron",),
              architectures=("blackwell",), scale_block=MX_BLOCK),
)}
del B, F


def is_fp8(precision: str) -> bool:
    return precision == "fp8"


def recipe_of(config: ParallelConfig) -> Fp8Recipe:
    """The `Fp8Recipe` an fp8 configuration runs (its `fp8_recipe`, resolved by ParallelConfig)."""
    return RECIPES[config.fp8_recipe]


def check_fp8_supported(cluster: ClusterProfile, precision: str, fp8_recipe: str | None = None) -> None:
    """MeshplanError unless the profile's device has FP8 tensor cores and an fp8 efficiency, and
    runs `fp8_recipe` (MXFP8 needs Blackwell's block-scaled tensor cores)."""
    if not is_fp8(precision):
        if fp8_recipe is not None:
            raise MeshplanError(f"--fp8-recipe {fp8_recipe} needs --precision fp8 (got {precision})")
        return
    device = cluster.device
    if "fp8" not in device.peak_flops_per_s:
        raise MeshplanError(f"--precision {precision}: {device.name} (profile {cluster.name!r}) has no FP8 tensor "
                            "cores (Hopper and newer have them; the profile lists no fp8 peak); use --precision "
                            "bf16-mixed")
    if device.fp8_matmul_efficiency <= 0:
        raise MeshplanError(f"--precision {precision}: profile {cluster.name!r} lists an fp8 peak but no "
                            "device.fp8_matmul_efficiency; add it (h100-sxm.toml says how its value was set)")
    if fp8_recipe is None:
        return
    if fp8_recipe not in RECIPES:
        raise MeshplanError(f"--fp8-recipe must be one of {', '.join(RECIPES)}, got {fp8_recipe!r}")
    needs = RECIPES[fp8_recipe].architectures
    if needs and device.architecture not in needs:
        raise MeshplanError(f"--fp8-recipe {fp8_recipe}: {device.name} (profile {cluster.name!r}, architecture "
                            f"{device.architecture or 'unknown'}) has no block-scaled FP8 tensor cores (MXFP8 needs "
                            f"{' or '.join(needs)}); use --fp8-recipe tensorwise, rowwise or delayed")


def fp8_gemm_time_s(flops: float, num_gemms: int, cluster: ClusterProfile) -> float:
    """Seconds of `flops` split over `num_gemms` equal fp8 GEMMs whose shapes are unknown: fp8
    peak x fp8_matmul_efficiency x f / (f + f_half x fp8 peak / bf16 peak), f the FLOPs of one
    GEMM (no launch overhead: the layer's kernel sequence already pays it)."""
    if flops <= 0:
        return 0.0
    check_fp8_supported(cluster, "fp8")
    device = cluster.device
    peak = device.peak_flops_per_s["fp8"]
    half = gemm.fp8_half_efficiency_flops(device)
    per_gemm = flops / max(1, num_gemms)
    return flops / (peak * device.fp8_matmul_efficiency * per_gemm / (per_gemm + half))


# Engines whose routed experts' grouped GEMMs run in fp8 under --precision fp8: Megatron-Core's
# TEGroupedMLP (megatron/core/transformer/moe/experts.py) is Transformer Engine's GroupedLinear,
# which the transformer layer's fp8_autocast quantises as any TE Linear (each expert's input,
# weight and output gradient its own tensor); torchtitan's Float8 converts nn.Linear only (its
# grouped experts need torchao's separate MoE converter, off by default), and meshplan's own
# executor runs no fp8.
FP8_EXPERT_ENGINES = ("megatron",)


def experts_in_fp8(config: ParallelConfig) -> bool:
    """Whether the configuration's routed experts run their grouped GEMMs in fp8 (`FP8_EXPERT_ENGINES`)."""
    return is_fp8(config.precision) and config.engine in FP8_EXPERT_ENGINES


def converts(layer: LayerProfile) -> bool:
    """Whether `layer` holds fp8 Linears: transformer blocks only (the head stays bf16)."""
    return layer.kind == "block" and layer.tp_split.kind == "block"


def _dense_mlp(layer: LayerProfile) -> bool:
    return layer.expert_params == 0  # an MoE block's MLP is grouped experts, not nn.Linear


def linear_params(layer: LayerProfile, info: ModelInfo, linears: Fp8Linears | None = None) -> float:
    """Parameters of the fp8 Linears of `layer` (whole layer, before TP): a block's parameters
    less its routed experts and its two norms' weights (biases counted with the Linears), the
    fp8 ones' share of them where a filter leaves some in bf16 (`linears`; None: every one)."""
    if not converts(layer):
        return 0.0
    share = 1.0 if linears is None else linears.param_share
    return share * max(0.0, float(layer.num_params - layer.expert_params - 2 * info.hidden))


def linear_flops(layer: LayerProfile, info: ModelInfo, seq: int) -> tuple[float, float]:
    """(forward, backward) FLOPs per sample of the fp8 Linears: the block's FLOPs less attention's
    core (4 s^2 h forward, twice that backward, counted in full as the profile does) and the
    routed experts."""
    if not converts(layer):
        return 0.0, 0.0
    attention_fwd = 4.0 * seq * seq * info.hidden
    fwd = layer.fwd_flops - attention_fwd - layer.expert_fwd_flops
    bwd = layer.bwd_flops - 2 * attention_fwd - layer.expert_bwd_flops
    return max(0.0, fwd), max(0.0, bwd)


def linear_input_bytes(layer: LayerProfile, info: ModelInfo, linears: Fp8Linears | None = None) -> tuple[float, float]:
    """(replicated, TP-sharded) bytes per sample, in the profile dtype, that the block's fp8
    Linears save as inputs: each region's norm output (q, k, v; up, gate), and inside the TP
    region o's input (s x h) and, for a dense MLP, down's input (s x ffn). The norm outputs count
    whether the profile keeps them or rebuilds them (`act_rebuilt_bytes`): an fp8 Linear keeps
    its own fp8 cast of its input either way. `linears`: the regions and row Linears a filter
    leaves in fp8 (`Fp8Linears` shares; None: every one)."""
    if not converts(layer):
        return 0.0, 0.0
    replicated = min(float(layer.input_bytes * input_regions(layer)),
                     float(layer.act_tp_replicated_bytes + layer.act_rebuilt_bytes))
    sharded = float(layer.input_bytes)
    if _dense_mlp(layer) and info.hidden and info.ffn:
        sharded += layer.input_bytes * info.ffn / info.hidden
    sharded = min(sharded, float(layer.act_tp_sharded_bytes))
    return (replicated, sharded) if linears is None else (replicated * linears.replicated_share,
                                                          sharded * linears.sharded_share)


def cast_values(layer: LayerProfile, info: ModelInfo, tp: int, mbs: float, elem_bytes: float,
                shapes: tuple = (), tokens: float = 0.0, on_shard: bool = False,
                linears: Fp8Linears | None = None, column_casts: float = 1.0) -> tuple[float, float, float]:
    """(input, weight, output-gradient) values one micro-batch casts to fp8 on one rank: the
    Linears' inputs (one cast per region, shared by q, k, v and by up, gate; the column Linears'
    whole, gathered under SP; the row Linears' /tp), their weights (/tp) and, with the block's
    `shapes`, each Linear's output gradient on `tokens` rows (column Linears' /tp); without
    shapes, as many gradient values as input values. `on_shard` (`fp8_tp_gather`): the column
    Linears' inputs and the row Linears' output gradients are cast before their all-gathers, on
    the rank's sequence shard (/tp). `linears`: the fp8 ones where a filter leaves some in bf16
    (`shapes` then the fp8 Linears'). `column_casts`: how many times each region's input is cast
    (`fp8_eager.column_casts_per_region`; 1, shared, as a compiled or fused stack casts it)."""
    replicated, sharded = linear_input_bytes(layer, info, linears)
    inputs = (replicated * column_casts / (tp if on_shard else 1) + sharded / tp) * mbs / elem_bytes
    grads = output_gradient_values(shapes, tokens, tp, on_shard) if shapes else inputs
    return inputs, linear_params(layer, info, linears) / tp, grads


def output_gradient_values(shapes, rows: float, tp: int, on_shard: bool = False) -> float:
    """Output-gradient values the (in, out, column) Linears `shapes` cast on `rows` rows, each split
    `tp` ways: a column Linear's output / tp, a row Linear's whole (/tp `on_shard`)."""
    return rows * sum(out_dim / tp if column or on_shard else out_dim for _, out_dim, column in shapes)


def fp8_tp_gather(layer: LayerProfile, config: ParallelConfig) -> bool:
    """Whether a block's sequence-parallel all-gathers move fp8 values: a dense block (its MLP
    nn.Linears) split over TP with SP, under a recipe whose engine casts before the gather
    (`Fp8Recipe.fp8_tp_gather_engines`). The backward's all-gathers of the row Linears' output
    gradients move fp8 too (the cast sits after the reduce-scatter, so its gradient is cast
    before the gather); reduce-scatters stay bf16 (the GEMMs' outputs)."""
    return (is_fp8(config.precision) and config.tp > 1 and config.sp and converts(layer) and _dense_mlp(layer)
            and config.engine in recipe_of(config).fp8_tp_gather_engines)


def tp_gather_bytes_share(layer: LayerProfile, config: ParallelConfig) -> float:
    """A block's TP all-gather bytes over bf16's: fp8's 1 byte per value where `fp8_tp_gather`."""
    return FP8_BYTES / BF16_BYTES if fp8_tp_gather(layer, config) else 1.0


# The rescale after an unscaled gradient GEMM reads its bf16 output and writes it back.
RESCALE_BYTES_PER_VALUE = 2 * BF16_BYTES


def gradient_rescale_s(recipe: Fp8Recipe, shapes, tokens: float, tp: int, values: tuple[float, float, float],
                       cluster: ClusterProfile) -> float:
    """Seconds of the recipe's rescale kernels over one micro-batch's gradient GEMMs
    (`Fp8Recipe.rescaled_gradient_gemms`): each Linear's input gradient (`tokens` x its local
    input) and weight gradient (its local weight). Without the block's `shapes`, the cast
    counts stand in: one input gradient per cast input, and the weights."""
    if not recipe.rescaled_gradient_gemms:
        return 0.0
    if shapes:
        outputs = 0.0
        for in_dim, out_dim, column in shapes:
            in_local = in_dim if column else in_dim / tp
            outputs += tokens * in_local + in_dim * out_dim / tp
    else:
        outputs = values[0] + values[1]
    return memory_time_s(outputs * RESCALE_BYTES_PER_VALUE, cluster)


# Engines whose fp8 Linears quantise a weight once per step and reuse it on every micro-batch
# (Megatron-Core passes Transformer Engine `is_first_microbatch`).
WEIGHT_CACHING_ENGINES = ("megatron",)


def fp8_primary_weights(config: ParallelConfig) -> bool:
    """Whether the engine keeps the Linears' weights as fp8 tensors, with no bf16 copy: Megatron-LM's
    `--fp8-param-gather` (Transformer Engine's `fp8_model_init`; the distributed optimizer keeps the
    fp32 master), which the recipe's fp8 all-gather under that engine means
    (`Fp8Recipe.fp8_gather_engines`) and Megatron-Bridge's FP8 recipes set
    (`src/megatron/bridge/training/mixed_precision.py`: `fp8_param_gather = True` in
    `bf16_with_fp8_current_scaling_mixed` and the MXFP8 recipe). ZeRO 1-2 only: the distributed
    optimizer it needs, without Megatron FSDP's sharded parameters (priced apart)."""
    return (is_fp8(config.precision) and config.engine in WEIGHT_CACHING_ENGINES and config.zero in (1, 2)
            and config.engine in recipe_of(config).fp8_gather_engines)


def weight_cast_share(config: ParallelConfig) -> float:
    """The share of a weight's cast one micro-batch pays: 1, or 1 / micro-batches per step where
    the engine caches the fp8 weight across them."""
    return 1.0 / config.num_microbatches if config.engine in WEIGHT_CACHING_ENGINES else 1.0


def cast_times_s(recipe: Fp8Recipe, values: tuple[float, float, float], weight_share: float,
                 cluster: ClusterProfile, fused: bool = False, weight_bytes: float | None = None,
                 gathered: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(forward, backward) seconds of a micro-batch's casts: inputs and weights forward, output
    gradients backward, at the recipe's bytes per value (a weight's `weight_bytes` where the
    engine casts it as it gathers, `gathered_weight_cast_bytes`) and the achieved memory bandwidth.

    `fused` (torch.compile, `engine_rules.runs_compiled`): an input's and an output gradient's
    cast begins inside the kernel that produced the tensor, so its first bf16 read is gone (the
    tensorwise amax pass, the rowwise and MXFP8 first quantisation's read); weights are cast as
    before. torchao's float8 roofline models compilation so (torchao/testing/training/roofline_utils.py,
    `get_tensor_memory_traffic_ovhd_s(..., fuse_with_prev)` for inputs and output gradients).
    Except the `gathered` (input, output-gradient) values (`collective_cast_values`): a collective
    produced them, and Inductor fuses nothing into a collective, so their casts read them whole."""
    inputs, weights, grads = values
    first_read = BF16_BYTES if fused else 0.0
    per_weight = recipe.weight_cast_bytes if weight_bytes is None else weight_bytes
    forward = (inputs * recipe.activation_cast_bytes - (inputs - gathered[0]) * first_read
               + weights * weight_share * per_weight)
    backward = grads * recipe.activation_cast_bytes - (grads - gathered[1]) * first_read
    return memory_time_s(forward, cluster), memory_time_s(backward, cluster)


def collective_cast_values(layer: LayerProfile, info: ModelInfo, config: ParallelConfig, tp: int, mbs: float,
                           elem_bytes: float, shapes: tuple, tokens: float,
                           linears: Fp8Linears | None = None) -> tuple[float, float]:
    """(input, output-gradient) values of `cast_values` whose tensor an all-gather produced: under
    sequence parallelism with bf16 gathers (not `fp8_tp_gather`), each region's gathered input
    to its column Linears, and the row Linears' output gradients, which the backward of their
    reduce-scatter gathers. torchao's rowwise recipe casts them so in torchtitan's TP plan."""
    if tp == 1 or not config.sp or fp8_tp_gather(layer, config):
        return 0.0, 0.0
    return gathered_values(layer, info, mbs, elem_bytes, shapes, tokens, linears)


def gathered_values(layer: LayerProfile, info: ModelInfo, mbs: float, elem_bytes: float, shapes: tuple,
                    tokens: float, linears: Fp8Linears | None = None) -> tuple[float, float]:
    """(input, output-gradient) values a block's sequence-parallel all-gathers hand its fp8 Linears
    whole: each region's input to its column Linears, and the row Linears' output gradients."""
    replicated, _ = linear_input_bytes(layer, info, linears)
    grads = tokens * sum(out_dim for _, out_dim, column in shapes if not column) if shapes else 0.0
    return replicated * mbs / elem_bytes, grads


def fp8_all_gather(config: ParallelConfig, zero: int, dp: int) -> bool:
    """Whether parameter all-gathers move fp8 Linear weights: ZeRO 1-3 over several ranks, under a
    recipe the engine gathers in fp8 (`Fp8Recipe.fp8_gather_engines`)."""
    return (is_fp8(config.precision) and zero >= 1 and dp > 1
            and config.engine in recipe_of(config).fp8_gather_engines)


# FSDP2 keeps the sharded parameters in fp32 (bf16-mixed's masters), which a float8 all-gather casts.
MASTER_BYTES = 4.0


def gathered_weight_cast_bytes(config: ParallelConfig) -> float | None:
    """Bytes per Linear weight value a micro-batch's casts move under FSDP2's float8 all-gather
    (torchao's WeightWithDynamicFloat8CastTensor; None elsewhere: the recipe's `weight_cast_bytes`).
    Each all-gather casts the rank's fp32 shard to fp8 before it (`fsdp_pre_all_gather`, at the
    scale `precompute_float8_dynamic_scale_for_fsdp` computed once a step): 5 bytes per shard
    value, twice a micro-batch under ZeRO-3 (gathered again for the backward), once below; the
    input gradient's GEMM then copies the gathered fp8 weight into its transposed layout
    (torchao's `preprocess_addmm`), a byte read and written per value. Megatron's fp8 weights
    are cast once a step (`weight_cast_share`)."""
    zero, dp = config.zero, config.data_ranks
    if not fp8_all_gather(config, zero, dp) or config.engine in WEIGHT_CACHING_ENGINES:
        return None
    gathers = 2 if zero == 3 else 1
    return 2 * FP8_BYTES + gathers * (MASTER_BYTES + FP8_BYTES) / config.shard_degree


def gemm_times_s(layer: LayerProfile, info: ModelInfo, cluster: ClusterProfile, config: ParallelConfig,
                 fwd_flops: float, bwd_flops: float, tp: int, profile_dtype: str,
                 attention_fwd_flops: float = 0.0, attention_efficiency: float = 0.0,
                 pieces=None) -> tuple[float, float]:
    """(forward, backward) GEMM and cast seconds of one micro-batch of a block on one rank under
    the configuration's fp8 recipe. `fwd_flops`/`bwd_flops`: the layer's local FLOPs as bf16
    would run them (causal skip, micro-batch and TP applied); the fp8 Linears' share runs in fp8
    by shape (`gemm.linear_times_s`; on the fp8 size curve when the shapes are unknown), the rest
    (attention's core, routed experts) on the bf16 curve with attention's two products, except
    `attention_fwd_flops` of flash attention (local; twice as many backward), which run at the
    kernel's `attention_efficiency` (`device_time.attention_time_s`). `pieces`: per block Linear,
    its forward's and input gradient's row chunks (`gemm.linear_times_s`)."""
    check_fp8_supported(cluster, config.precision, config.fp8_recipe)  # a plan's recipe on its cluster
    recipe, mbs = recipe_of(config), config.rank_microbatch
    seq = infer_seq(layer, info, profile_dtype)
    linears = fp8_linears(layer, info, config, profile_dtype)  # which run in fp8; the rest as bf16 Linears
    shapes, tokens = linears.fp8_shapes, mbs * seq
    if linears.shapes:
        lin_fwd = gemm.linear_flops(linears.shapes, tokens, tp)
        lin_bwd = 2 * lin_fwd
        fp8_pieces, bf16_pieces = ((tuple(p for p, fp8_on in zip(pieces, linears.in_fp8) if fp8_on is want)
                                    for want in (True, False)) if pieces else (None, None))
        accumulate = wgrad_accumulator_bytes(config)  # the engine's gradient buffer, read and written
        fp8_fwd_s, fp8_bwd_s = gemm.linear_times_s(shapes, tokens, tp, cluster, "fp8", recipe.scale_block, fp8_pieces,
                                                   accumulate)
        bf16_fwd_s, bf16_bwd_s = gemm.linear_times_s(linears.bf16_shapes, tokens, tp, cluster, "bf16",
                                                     pieces=bf16_pieces, wgrad_accumulate_bytes=accumulate)
        fp8_fwd_s, fp8_bwd_s = fp8_fwd_s + bf16_fwd_s, fp8_bwd_s + bf16_bwd_s
    else:
        lin_fwd, lin_bwd = (flops * mbs / tp for flops in linear_flops(layer, info, seq))
        num_linears = len(layer.tp_split.column_linears) + len(layer.tp_split.row_linears)
        fp8_fwd_s = fp8_gemm_time_s(lin_fwd, num_linears, cluster)
        fp8_bwd_s = fp8_gemm_time_s(lin_bwd, 2 * num_linears, cluster)
    cast_fwd_s = cast_bwd_s = 0.0
    if shapes or not linears.shapes:  # some Linear casts (a block left wholly in bf16 casts nothing)
        cast_fwd_s, cast_bwd_s = _block_cast_times_s(layer, info, cluster, config, linears, tp, tokens,
                                                     DTYPE_BYTES.get(profile_dtype, 2))
    rest_fwd_s, rest_bwd_s = gemm_and_attention_times_s(max(0.0, fwd_flops - lin_fwd), max(0.0, bwd_flops - lin_bwd),
                                                        attention_fwd_flops, ATTENTION_BMMS_PER_BLOCK, cluster, "bf16",
                                                        attention_efficiency)
    return rest_fwd_s + fp8_fwd_s + cast_fwd_s, rest_bwd_s + fp8_bwd_s + cast_bwd_s


def _block_cast_times_s(layer: LayerProfile, info: ModelInfo, cluster: ClusterProfile, config: ParallelConfig,
                        linears: Fp8Linears, tp: int, tokens: float, elem_bytes: float) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's casts of a block's fp8 Linears: as the
    recipe casts them (`cast_times_s`), or each Linear's own activation casts where torchao runs
    eagerly (`fp8_eager`; weights as the recipe casts them), plus rowwise's gradient rescales."""
    recipe, mbs = recipe_of(config), config.rank_microbatch
    shapes, filtered = linears.fp8_shapes, (None if linears.everything else linears)
    on_shard = fp8_tp_gather(layer, config)
    values = cast_values(layer, info, tp, mbs, elem_bytes, shapes, tokens, on_shard, filtered)
    if casts_eagerly(config) and not on_shard:
        weight_fwd_s, _ = cast_times_s(recipe, (0.0, values[1], 0.0), weight_cast_share(config), cluster,
                                       weight_bytes=gathered_weight_cast_bytes(config))
        inputs, _, grads = cast_values(layer, info, tp, mbs, elem_bytes, shapes, tokens, on_shard, filtered,
                                       column_casts_per_region(layer, linears))
        input_fwd_s, cast_bwd_s = activation_cast_times_s(inputs, grads, cluster)
        cast_fwd_s = weight_fwd_s + input_fwd_s
    else:
        cast_fwd_s, cast_bwd_s = cast_times_s(recipe, values, weight_cast_share(config), cluster,
                                              runs_compiled(config), gathered_weight_cast_bytes(config),
                                              collective_cast_values(layer, info, config, tp, mbs, elem_bytes,
                                                                     shapes, tokens, filtered))
    if on_shard:  # the gathered fp8 tensors' transposed copies (`fp8_layouts`)
        layout_fwd_s, layout_bwd_s = gathered_transpose_times_s(
            *gathered_values(layer, info, mbs, elem_bytes, shapes, tokens, filtered), tp, cluster)
        cast_fwd_s, cast_bwd_s = cast_fwd_s + layout_fwd_s, cast_bwd_s + layout_bwd_s
    return cast_fwd_s, cast_bwd_s + gradient_rescale_s(recipe, shapes, tokens, tp, values, cluster)


def linear_seconds(m: int, k: int, n: int, cluster: ClusterProfile, recipe: str = "tensorwise",
                   compiled: bool = False) -> tuple[float, float]:
    """(bf16, fp8) seconds of one Linear (input m x k, weight k x n) forward and backward: its three
    GEMMs by shape each way, and in fp8 the casts of its input, weight and output gradient under
    `recipe` (`compiled`: torch.compile fuses the casts' first reads, `cast_times_s`) with
    rowwise's gradient rescales: what torchao's float8 Linear benchmarks time."""
    def gemms_s(dtype: str, scale_block: int = 0) -> float:  # forward, input and weight gradients
        return sum(gemm.gemm_time_s(*shape, cluster, dtype, scale_block) for shape in ((m, n, k), (m, k, n), (k, n, m)))
    chosen = RECIPES[recipe]
    values = (m * k, k * n, m * n)
    cast_s = sum(cast_times_s(chosen, values, 1.0, cluster, compiled))
    cast_s += gradient_rescale_s(chosen, ((k, n, True),), m, 1, values, cluster)
    return gemms_s("bf16"), gemms_s("fp8", chosen.scale_block) + cast_s


def linear_speedup(m: int, k: int, n: int, cluster: ClusterProfile, recipe: str = "tensorwise",
                   compiled: bool = False) -> float:
    """How many times faster one Linear runs forward and backward in fp8 under `recipe` than in
    bf16 (`linear_seconds`)."""
    bf16_s, fp8_s = linear_seconds(m, k, n, cluster, recipe, compiled)
    return bf16_s / fp8_s
