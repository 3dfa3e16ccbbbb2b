"""The precision recipes, and how a layer's tensors split under tensor parallelism (Megatron's
padded vocabulary). What a layer runs under is a `ParallelConfig` (`costing.uniform.layer_config`)."""
from __future__ import annotations

from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing.device_time import DTYPE_BYTES


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
