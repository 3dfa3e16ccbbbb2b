"""How a layer's tensors split under tensor parallelism: which layers split, and Megatron's
vocabulary padded to a multiple of 128 * tp (the profile was built for tp = 1)."""
from __future__ import annotations

from meshplan.planner.contracts.graph import LayerProfile, ModelInfo


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
