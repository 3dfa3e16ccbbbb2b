"""The FP8 precision recipe: every rule the cost model applies under `precision="fp8"`, once.

`fp8` is torchao's `Float8Linear` with tensorwise dynamic ("current") scaling, as torchtitan
runs it: the model compiled, FSDP2 with float8 all-gather (`enable_fsdp_float8_all_gather`) and
the fp8 weight recast in backward (`force_recompute_fp8_weight_in_bwd`), the output Linear (the
head) left in bf16 (torchtitan's default `filter_fqns = ["output"]`). `layer_cost.layer_cost`
reads these functions, so the ILP and the simulator charge the same thing.

Compute, per micro-batch on one rank:
- the dense Linears of a transformer block (q, k, v, o and the MLP's up, gate, down): forward,
  input-gradient and weight-gradient GEMMs at the profile's `fp8` peak x `fp8_matmul_efficiency`
  (`fp8_gemm_time_s`), on the bf16 size curve f / (f + f_half) with f_half scaled by the peak
  ratio fp8 / bf16 (the same fixed time per GEMM is worth that many more FLOPs);
- everything else as under bf16-mixed, in bf16: attention's core (SDPA), norms and elementwise
  work, the embedding, the head, MoE routed experts (grouped GEMMs are not `nn.Linear`);
- the casts: each GEMM operand is cast from bf16 to fp8 with a fresh tensorwise scale, memory-
  bound: `FP8_CAST_BYTES_PER_VALUE` (read 2, write 1; the amax reduction assumed fused into the
  kernel that produces the tensor, as torch.compile does) at the achieved memory bandwidth.
  Forward casts each Linear input once (one cast per region shared by q, k, v / up, gate) and
  every weight; backward casts the output gradients, the weights again and the saved inputs in
  the weight gradient's layout, counted as twice the forward's values (`cast_values`).

Memory per rank:
- model states as bf16-mixed (fp32 masters and Adam moments, FSDP2's bf16 compute copy);
- saved for backward: the block's Linear inputs in fp8, 1 byte per value instead of 2 (the
  eager `Float8Linear` keeps its bf16 input and relies on torch.compile to save the fp8 cast,
  pytorch/ao#1850); everything else stays bf16 (`saved_bytes_saving`);
- the fp8 weight copy: each Linear's fp8 weight lives while its GEMMs run and is recast in
  backward, a transient of 1 byte per Linear parameter (`transient_bytes`); with float8
  all-gather the gathered copy already is that weight. Scale state: one fp32 scale per cast
  tensor (input, weight, gradient) per Linear, `FP8_SCALE_BYTES_PER_LINEAR`, with the buffers;
- ZeRO 1-3 (FSDP2 `fully_shard`): float8 all-gather casts each Linear's weight shard to fp8
  before the gather, so parameter all-gathers move 1 byte per Linear parameter instead of 2 and
  the unsharded copy FSDP2 holds is fp8 (`gather_bytes_per_param`).

Not modelled: TP's float8 all-gathers (torchtitan's Float8ColwiseParallel), delayed scaling,
rowwise scaling, fp8 attention. Not executed: `meshplan train` refuses fp8 plans.
"""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing.activation_memory import keeps_gathered_input
from meshplan.planner.costing.device_time import (ATTENTION_BMMS_PER_BLOCK, DTYPE_BYTES, gemm_and_attention_times_s,
                                                  infer_seq, memory_time_s)

FP8_RECIPES = ("fp8",)
FP8_BYTES = 1.0
BF16_BYTES = 2.0
# bf16 -> fp8 cast: read the bf16 value, write the fp8 one (amax fused into the producer).
FP8_CAST_BYTES_PER_VALUE = BF16_BYTES + FP8_BYTES
# One fp32 scale per cast tensor of a Linear: input, weight, output gradient.
FP8_SCALE_BYTES_PER_LINEAR = 3 * 4.0
# Backward casts about twice the forward's values (output gradients, weights, inputs re-laid out).
BACKWARD_CAST_FACTOR = 2.0


def is_fp8(precision: str) -> bool:
    return precision in FP8_RECIPES


def check_fp8_supported(cluster: ClusterProfile, precision: str) -> None:
    """MeshplanError unless the profile's device has FP8 tensor cores and an fp8 efficiency."""
    if not is_fp8(precision):
        return
    device = cluster.device
    if "fp8" not in device.peak_flops_per_s:
        raise MeshplanError(f"--precision {precision}: {device.name} (profile {cluster.name!r}) has no FP8 tensor "
                            "cores (Hopper and newer have them; the profile lists no fp8 peak); use --precision "
                            "bf16-mixed")
    if device.fp8_matmul_efficiency <= 0:
        raise MeshplanError(f"--precision {precision}: profile {cluster.name!r} lists an fp8 peak but no "
                            "device.fp8_matmul_efficiency; add it (h100-sxm.toml says how its value was set)")


def fp8_gemm_time_s(flops: float, num_gemms: int, cluster: ClusterProfile) -> float:
    """Seconds of `flops` split over `num_gemms` equal fp8 GEMMs: fp8 peak x fp8_matmul_efficiency
    x f / (f + f_half x fp8 peak / bf16 peak), f the FLOPs of one GEMM (no launch overhead: the
    layer's kernel sequence already pays it)."""
    if flops <= 0:
        return 0.0
    check_fp8_supported(cluster, "fp8")
    device = cluster.device
    peak = device.peak_flops_per_s["fp8"]
    half = device.matmul_half_efficiency_flops * peak / device.peak_flops("bf16")
    per_gemm = flops / max(1, num_gemms)
    return flops / (peak * device.fp8_matmul_efficiency * per_gemm / (per_gemm + half))


def converts(layer: LayerProfile) -> bool:
    """Whether `layer` holds fp8 Linears: transformer blocks only (the head stays bf16)."""
    return layer.kind == "block" and layer.tp_split.kind == "block"


def _dense_mlp(layer: LayerProfile) -> bool:
    return layer.expert_params == 0  # an MoE block's MLP is grouped experts, not nn.Linear


def linear_params(layer: LayerProfile, info: ModelInfo) -> float:
    """Parameters of the fp8 Linears of `layer` (whole layer, before TP): a block's parameters
    less its routed experts and its two norms' weights (biases counted with the Linears)."""
    if not converts(layer):
        return 0.0
    return max(0.0, float(layer.num_params - layer.expert_params - 2 * info.hidden))


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


def linear_input_bytes(layer: LayerProfile, info: ModelInfo) -> tuple[float, float]:
    """(replicated, TP-sharded) bytes per sample, in the profile dtype, that the block's fp8
    Linears save as inputs: each region's norm output (q, k, v; up, gate), and inside the TP
    region o's input (s x h) and, for a dense MLP, down's input (s x ffn). The norm outputs count
    whether the profile keeps them or rebuilds them (`act_rebuilt_bytes`): an fp8 Linear keeps
    its own fp8 cast of its input either way."""
    if not converts(layer):
        return 0.0, 0.0
    regions = layer.tp_split.num_allreduce_per_pass if _dense_mlp(layer) else 1
    replicated = min(float(layer.input_bytes * regions),
                     float(layer.act_tp_replicated_bytes + layer.act_rebuilt_bytes))
    sharded = float(layer.input_bytes)
    if _dense_mlp(layer) and info.hidden and info.ffn:
        sharded += layer.input_bytes * info.ffn / info.hidden
    return replicated, min(sharded, float(layer.act_tp_sharded_bytes))


def saved_bytes_saving(layer: LayerProfile, info: ModelInfo, tp: int, sp: bool, gathered: bool,
                       mbs: int, scale: float) -> float:
    """Bytes per micro-batch the fp8 Linears' saved inputs take less than bf16 ones: half of
    them (sharded ones /tp, replicated ones /tp under SP unless kept gathered), less the fp8
    casts of norm outputs the bf16 profile rebuilds rather than keeps."""
    replicated, sharded = linear_input_bytes(layer, info)
    rebuilt = min(replicated, float(layer.act_rebuilt_bytes))
    shard = 1 if gathered or not sp else tp
    saving = (1 - FP8_BYTES / BF16_BYTES) * (replicated / shard + sharded / tp) - rebuilt / shard
    return saving * mbs * scale


def cast_values(layer: LayerProfile, info: ModelInfo, tp: int, mbs: int, elem_bytes: float) -> float:
    """Values cast to fp8 in one micro-batch's forward on one rank: the Linears' inputs (the
    column Linears' whole, gathered under SP; the row Linears' /tp) and their weights (/tp)."""
    replicated, sharded = linear_input_bytes(layer, info)
    return (replicated + sharded / tp) * mbs / elem_bytes + linear_params(layer, info) / tp


def fp8_all_gather(precision: str, zero: int, dp: int) -> bool:
    """Whether parameter all-gathers move fp8 Linear weights (float8 all-gather under FSDP2)."""
    return is_fp8(precision) and zero >= 1 and dp > 1


def gather_bytes_per_param(layer: LayerProfile, info: ModelInfo, precision: str, zero: int, dp: int,
                           compute_bytes: float) -> float:
    """Bytes per parameter a parameter all-gather moves (and the unsharded copy holds)."""
    if not fp8_all_gather(precision, zero, dp) or not layer.num_params:
        return compute_bytes
    share = linear_params(layer, info) / layer.num_params
    return compute_bytes - share * (compute_bytes - FP8_BYTES)


def transient_bytes(layer: LayerProfile, info: ModelInfo, tp: int, precision: str, zero: int, dp: int) -> float:
    """The fp8 weight copy each Linear casts for its GEMMs (unless float8 all-gather's gathered
    copy is it) and the scale state, per rank."""
    if not is_fp8(precision) or not converts(layer):
        return 0.0
    num_linears = len(layer.tp_split.column_linears) + len(layer.tp_split.row_linears)
    copy = 0.0 if fp8_all_gather(precision, zero, dp) else FP8_BYTES * linear_params(layer, info) / tp
    return copy + FP8_SCALE_BYTES_PER_LINEAR * num_linears


def gemm_times_s(layer: LayerProfile, info: ModelInfo, cluster: ClusterProfile, fwd_flops: float,
                 bwd_flops: float, tp: int, mbs: int, profile_dtype: str,
                 attention_fwd_flops: float = 0.0, attention_efficiency: float = 0.0) -> tuple[float, float]:
    """(forward, backward) GEMM and cast seconds of one micro-batch of a block on one rank under
    fp8. `fwd_flops`/`bwd_flops`: the layer's local FLOPs as bf16 would run them (causal skip,
    micro-batch and TP applied); the fp8 Linears' share goes to `fp8_gemm_time_s`, the rest
    (attention's core, routed experts) to the bf16 curve with attention's two products, except
    `attention_fwd_flops` of flash attention (local; twice as many backward), which run at the
    kernel's `attention_efficiency` (`device_time.attention_time_s`)."""

    lin_fwd, lin_bwd = (flops * mbs / tp for flops in linear_flops(layer, info, infer_seq(layer, info, profile_dtype)))
    num_linears = len(layer.tp_split.column_linears) + len(layer.tp_split.row_linears)
    values = cast_values(layer, info, tp, mbs, DTYPE_BYTES.get(profile_dtype, 2))
    cast_s = memory_time_s(values * FP8_CAST_BYTES_PER_VALUE, cluster)
    rest_fwd_s, rest_bwd_s = gemm_and_attention_times_s(fwd_flops - lin_fwd, bwd_flops - lin_bwd, attention_fwd_flops,
                                                        ATTENTION_BMMS_PER_BLOCK, cluster, "bf16", attention_efficiency)
    fwd_s = rest_fwd_s + fp8_gemm_time_s(lin_fwd, num_linears, cluster) + cast_s
    bwd_s = rest_bwd_s + fp8_gemm_time_s(lin_bwd, 2 * num_linears, cluster) + BACKWARD_CAST_FACTOR * cast_s
    return fwd_s, bwd_s


def adjust_memory(layer: LayerProfile, info: ModelInfo, config, split: bool, executor: bool, zero: int,
                  scale: float, activation_bytes: float, buffer_bytes: float) -> tuple[float, float]:
    """(saved, transient) bytes per micro-batch under fp8 from bf16-mixed's: the Linears' saved
    inputs in fp8 (in the recompute working set under full recomputation, which keeps only the
    block's input) and the fp8 weight copies and scales. `scale`: compute over profile element size."""
    if not is_fp8(config.precision) or not converts(layer):
        return activation_bytes, buffer_bytes
    tp = config.tp if split else 1
    gathered = keeps_gathered_input(layer, config, executor)
    saving = saved_bytes_saving(layer, info, tp, config.sp, gathered, config.rank_microbatch, scale)
    if config.recompute == "full":
        buffer_bytes -= saving
    else:
        activation_bytes -= saving
    return activation_bytes, buffer_bytes + transient_bytes(layer, info, tp, config.precision, zero, config.data_ranks)
