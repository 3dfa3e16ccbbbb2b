"""How one layer runs on one rank: the `Strategy` record, the precision recipes, and how a
layer's tensors split under a strategy's tensor parallelism (Megatron's padded vocabulary)."""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing.device_time import DTYPE_BYTES


@dataclass(frozen=True)
class Strategy:
    """How one layer runs: mesh degrees it sees, ZeRO stage, recomputation, SP, micro-batch size.

    Mesh order is (pp, dp, tp) with tp innermost: a TP group is `tp` consecutive ranks, a DP group
    is `dp` ranks spaced `tp` apart, pipeline neighbours are `dp * tp` ranks apart.
    """

    tp: int = 1
    dp: int = 1
    zero: int = 0
    recompute: str = "none"  # none | selective | full
    sp: bool = False
    microbatch_size: int = 1
    precision: str = "bf16-mixed"  # bf16-mixed | fp32 | fp8
    pp: int = 1  # only for which link pipeline transfers cross
    # Where model states live: "executor" (what `meshplan train` allocates) or "zero-paper"
    # (Rajbhandari et al.'s 2 + 2 + 12 bytes per parameter); see planner.costing.state_memory.
    state_recipe: str = "executor"
    # HSDP: ZeRO shards over groups of this many consecutive dp ranks (stride tp) and replicates
    # across dp / shard_group of them; None shards over all dp ranks.
    shard_group: int | None = None
    # Context parallelism: each of `cp` ranks (tp apart) holds 1/cp of every sequence.
    cp: int = 1
    # Expert parallelism: MoE blocks' routed experts split over `ep` data ranks (tp apart), carved
    # out of dp * cp (planner.costing.expert_parallel).
    ep: int = 1




# Bytes per parameter of each precision recipe (the ZeRO paper's mixed-precision
# Adam; plain fp32 Adam needs no master copy: 4 param + 4 grad + 2 x 4 moments).
PRECISION_RECIPES: dict[str, dict[str, float]] = {
    "bf16-mixed": {"param": 2.0, "grad": 2.0, "optimizer": 12.0},
    "fp32": {"param": 4.0, "grad": 4.0, "optimizer": 8.0},
    "fp8": {"param": 2.0, "grad": 2.0, "optimizer": 12.0},  # bf16-mixed's states; see planner.costing.fp8
}
# The dtype of everything but the fp8 Linears' GEMMs (fp8: attention, norms, activations in bf16).
COMPUTE_DTYPE = {"bf16-mixed": "bf16", "fp32": "fp32", "fp8": "bf16"}


def recipe(precision: str) -> dict[str, float]:
    """Bytes per parameter of `precision`'s params, grads and optimizer states."""
    if precision not in PRECISION_RECIPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_RECIPES)}, got {precision!r}")
    return PRECISION_RECIPES[precision]


def is_split(layer: LayerProfile, tp: int) -> bool:
    """Whether tensor parallelism splits `layer` (a block, or a vocab-parallel embedding or head)."""
    return tp > 1 and layer.tp_split.kind in ("block", "vocab")


def vocab_scale(layer: LayerProfile, tp: int, info: ModelInfo) -> float:
    """Megatron pads the vocabulary to a multiple of 128*t: the profile was built for t = 1."""
    if layer.tp_split.kind != "vocab" or tp == 1 or not info.vocab or not info.padded_vocab:
        return 1.0
    multiple = 128 * tp
    padded = -(-info.vocab // multiple) * multiple
    return padded / info.padded_vocab


def extra_vocab_params(layer: LayerProfile, tp: int, info: ModelInfo) -> float:
    """Parameters the vocabulary's padding to a multiple of 128*t adds to an embedding or head."""
    scale = vocab_scale(layer, tp, info)
    if scale == 1.0 or layer.num_params < info.padded_vocab * info.hidden:
        return 0.0  # a head whose weight is tied to the embedding owns no vocab rows
    return (scale - 1.0) * info.padded_vocab * info.hidden


def activation_scale(precision: str, profile_dtype: str | None) -> float:
    """Bytes per activation element in the precision's compute dtype over the profile's."""
    dtype = COMPUTE_DTYPE[precision]
    return DTYPE_BYTES[dtype] / DTYPE_BYTES.get(profile_dtype or dtype, 2)
