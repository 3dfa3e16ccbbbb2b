"""How a layer's tensors split under tensor parallelism: which layers split, the engines' vocabulary
split of a Hugging Face model's embedding and head, and Megatron's vocabulary padded to a multiple
of 128 * tp (the profile was built for tp = 1)."""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.engine_rules import VOCAB_PARALLEL_ENGINES
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo, TPSplit

# Megatron-LM's --make-vocab-size-divisible-by default: the vocabulary is padded to a multiple of 128 * tp.
VOCAB_DIVISOR = 128
# (id(layer), tp) -> (layer, the layer as a vocab-parallel engine splits it). The layer is kept so
# its id is never reused while the entry lives: the cost memos key on id(layer).
_ENGINE_SPLITS: dict[tuple[int, int], tuple[LayerProfile, LayerProfile]] = {}


def as_engine_splits(layer: LayerProfile, engine: str, tp: int, info: ModelInfo) -> LayerProfile:
    """`layer` as `engine` splits it at `tp`: a Hugging Face model's embedding and head, which the
    profile records replicated (meshplan's executor keeps them whole), are vocab-parallel under the
    engines that split every model's vocabulary (`engine_rules.VOCAB_PARALLEL_ENGINES`), their
    vocabulary padded to a multiple of 128 * tp as Megatron-LM pads it (`vocab_scale` prices the
    padding). Any other layer is returned as it is. The same object for the same layer and tp."""
    if (tp == 1 or engine not in VOCAB_PARALLEL_ENGINES or info.family != "hf"
            or layer.kind not in ("embedding", "head") or layer.tp_split.kind != "none" or not info.vocab):
        return layer
    key = (id(layer), tp)
    if key not in _ENGINE_SPLITS:
        split = TPSplit(kind="vocab", vocab_size=megatron_padded_vocab(info.vocab, tp))
        _ENGINE_SPLITS[key] = (layer, replace(layer, tp_split=split))
    return _ENGINE_SPLITS[key][1]


def megatron_padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary padded to a multiple of 128 * tp, as Megatron-LM pads it."""
    multiple = VOCAB_DIVISOR * tp
    return -(-vocab // multiple) * multiple


def is_split(layer: LayerProfile, tp: int) -> bool:
    """Whether tensor parallelism splits `layer` (a block, or a vocab-parallel embedding or head)."""
    return tp > 1 and layer.tp_split.kind in ("block", "vocab")


def vocab_scale(layer: LayerProfile, tp: int, info: ModelInfo) -> float:
    """Megatron pads the vocabulary to a multiple of 128*t: the profile was built for t = 1."""
    if layer.tp_split.kind != "vocab" or tp == 1 or not info.vocab or not info.padded_vocab:
        return 1.0
    return megatron_padded_vocab(info.vocab, tp) / info.padded_vocab


def extra_vocab_params(layer: LayerProfile, tp: int, info: ModelInfo) -> float:
    """Parameters the vocabulary's padding to a multiple of 128*t adds to an embedding or head."""
    scale = vocab_scale(layer, tp, info)
    if scale == 1.0 or layer.num_params < info.padded_vocab * info.hidden:
        return 0.0  # a head whose weight is tied to the embedding owns no vocab rows
    return (scale - 1.0) * info.padded_vocab * info.hidden


def rank_params(layer: LayerProfile, info: ModelInfo, tp: int, ep: int, expert_tp: int,
                holds_shared: bool = False) -> tuple[float, float]:
    """(dense, routed experts) parameters of `layer` on one rank: the layer's own (a padded
    vocabulary's rows, and a tied copy where the rank holds it, included) / tp when TP splits it,
    and its routed experts' / (ep expert_tp): expert tensor parallelism, not the dense layers'
    TP, splits each expert (MoE parallel folding, `expert_parallel`). Every memory recipe and the
    gradient copies read their counts here."""
    dense = layer.num_params - layer.expert_params + extra_vocab_params(layer, tp, info)
    if holds_shared:
        dense += layer.shared_params
    return dense / (tp if is_split(layer, tp) else 1), layer.expert_params / ep / expert_tp
