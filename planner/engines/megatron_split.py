"""Megatron-LM's pipeline cut both ways: a plan's chunks as its split arguments (even, uneven
first and last stages, or the exact `--pipeline-model-parallel-layout`), those arguments read
back as layers per chunk, and the multi-token-prediction depths (`--mtp-num-layers`), which
Megatron-Core builds on the last stage beside the output layer and counts apart from the
decoder's layers. Split from `megatron`, whose export and reader call these."""
from __future__ import annotations

import re

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import MTP_LAYER_PREFIX, is_mtp_layer
from meshplan.planner.engines import job as layout
from meshplan.planner.engines.megatron_hf import HYBRID_FLAG
from meshplan.planner.profiling.mtp import config_mtp_layers

# Megatron-Core's exact pipeline cut: the layers of every (virtual) stage, in model order.
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
VPP_FLAG = "--num-virtual-stages-per-pipeline-rank"


def mtp_args(plan, notes: list[str]) -> list[tuple[str, object]]:
    """`--mtp-num-layers` for a plan costed with multi-token prediction (`profiling.mtp`), whose
    depths Megatron-Core builds on the last pipeline stage; a note where the config names MTP
    depths the plan was costed without."""
    depths = plan.model.mtp_num_layers
    if depths:
        chunks = [plan.chunk_of(layer) for layer in plan.layers if is_mtp_layer(layer)]
        last = plan.config.num_model_chunks - 1
        if any(chunk != last for chunk in chunks):
            raise MeshplanError(f"the plan puts multi-token prediction on pipeline chunk {min(chunks)} of {last + 1}; "
                                "Megatron-Core builds it with the output layer on the last: re-plan with the MTP "
                                "layers there")
        return [("--mtp-num-layers", depths)]
    named = config_mtp_layers(plan.model.spec)
    if named:
        notes.append(f"the model's config names {named} multi-token-prediction layer(s); the plan was costed without "
                     f"them, so none is exported (plan with --mtp-num-layers {named} to train them)")
    return []


def split_args(plan, notes: list[str]) -> list[tuple[str, object]]:
    """Uneven first and last stages when that expresses the plan's cut, else the cut exactly as
    Megatron-Core's `--pipeline-model-parallel-layout`; nothing when the split is even."""
    cfg, blocks = plan.config, layout.blocks_per_chunk(plan)
    if cfg.pp * cfg.virtual_stages == 1:
        return []
    # Megatron's split counts the decoder's layers, its MTP depths stay on the last stage
    counts = tuple(len([i for i in chunk if not is_mtp_layer(plan.layers[i])])
                   for chunk in plan.chunks())
    if counts == even_counts(sum(blocks), len(blocks), None, None):
        return []
    first, last = blocks[0], blocks[-1]
    if cfg.virtual_stages == 1 and first and last and counts == even_counts(sum(blocks), len(blocks), first, last):
        return [("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)]
    return [(LAYOUT_FLAG, f"'{layout_text(plan)}'")]  # quoted: | is a pipe in a launch script


def hybrid_layout_args(plan, pattern: str, notes: list[str]) -> list[tuple[str, object]]:
    """A hybrid model's `--hybrid-layer-pattern`: its layer letters (`megatron_hf.hybrid_pattern`) with
    `|` after each pipeline chunk's last decoder layer, Megatron-Core's flexible layout, which also
    says the virtual stages (segments / pp); the pattern alone where the plan has one chunk."""
    if plan.config.pp * plan.config.virtual_stages == 1:
        return [(HYBRID_FLAG, f"'{pattern}'")]
    notes.append("the pipeline cut is written as | in --hybrid-layer-pattern (Megatron-LM's flexible hybrid layout, "
                 "2026 on); older releases take --hybrid-override-pattern, cut by count evenly and run no "
                 "virtual stages")
    segments = []
    for chunk in plan.chunks():
        blocks = [int(plan.layers[i].name.rpartition(".")[2]) for i in chunk
                  if plan.layers[i].name.startswith("blocks.")]
        segments.append("".join(pattern[b] for b in blocks))
    return [(HYBRID_FLAG, f"'{'|'.join(segments)}'")]  # quoted: | is a pipe in a launch script


def read_cut(flags, get, pp: int) -> tuple[int, tuple[int, ...] | None]:
    """(virtual stages, layers per chunk) of Megatron-LM arguments: a hybrid pattern's (Megatron-LM
    derives the depth, and a `|` cut, from it), else `--num-layers` with the split arguments."""
    if flags.get(HYBRID_FLAG):
        counts, num_layers, vpp = read_hybrid_split(flags[HYBRID_FLAG], pp)
        return vpp, counts or read_split(flags, get, pp, vpp, num_layers)
    num_layers = get("--num-layers", None)
    vpp = _virtual_stages(get, pp, num_layers)
    return vpp, read_split(flags, get, pp, vpp, num_layers)


def _virtual_stages(get, pp: int, num_layers: int | None) -> int:
    vpp = get(VPP_FLAG, None)
    per_chunk = get("--num-layers-per-virtual-pipeline-stage", None)
    layout_text = get.flags.get(LAYOUT_FLAG)
    if vpp is None and layout_text:  # the layout's stages are pp x virtual stages
        vpp = max(1, len(expand_layout(layout_text).split("|")) // pp)
    if vpp is None and per_chunk is not None:
        if num_layers is None or num_layers % (pp * per_chunk):
            raise MeshplanError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} needs --num-layers divisible "
                                f"by pp * {per_chunk}; got --num-layers {num_layers}")
        vpp = num_layers // (pp * per_chunk)
    return vpp or 1


def read_hybrid_split(pattern_text: str, pp: int) -> tuple[tuple[int, ...] | None, int, int]:
    """(layers per chunk, embedding on the first and head on the last; None for one chunk or an
    even split by count), the decoder's layer count and the virtual stages of a `--hybrid-layer-pattern`."""
    segments = pattern_text.strip("'\" ").split("/")[0].split("|")
    num_layers = sum(map(len, segments))
    if len(segments) == 1:
        return None, num_layers, 1
    if len(segments) % pp:
        raise MeshplanError(f"--hybrid-layer-pattern has {len(segments)} pipeline segments, not a multiple of "
                            f"--pipeline-model-parallel-size {pp}")
    counts = [len(segment) for segment in segments]
    counts[0] += 1  # the embedding
    counts[-1] += 1  # the output layer
    return tuple(counts), num_layers, len(segments) // pp


def layout_text(plan) -> str:
    """The plan's chunks in Megatron-Core's layout letters: E the embedding, t a transformer
    layer, L the output layer and loss; chunks in model order, separated by |."""
    letters = {"embed": "E", "head": "L"}

    def letter(name: str) -> str:
        return "m" if name.startswith(MTP_LAYER_PREFIX) else letters.get(name, "t")
    return "|".join("".join(letter(plan.layers[i].name) for i in chunk) for chunk in plan.chunks())


def even_counts(num_blocks: int, chunks: int, first: int | None, last: int | None) -> tuple[int, ...] | None:
    """Layers per chunk (embedding and head included) of Megatron's split with optional uneven
    first/last stages; None when the rest does not divide evenly."""
    fixed = [count for count in (first, last) if count is not None]
    rest, others = num_blocks - sum(fixed), chunks - len(fixed)
    if others < 0 or rest < others or (others and rest % others) or (not others and rest):
        return None
    blocks = [rest // others if others else 0] * chunks
    if first is not None:
        blocks[0] = first
    if last is not None:
        blocks[-1] = last
    blocks[0] += 1  # the embedding
    blocks[-1] += 1  # the output layer
    return tuple(blocks)


def read_split(flags, get, pp: int, vpp: int, num_layers: int | None) -> tuple[int, ...] | None:
    """Layers per chunk (embedding on the first, head on the last) as Megatron-LM splits them."""
    if flags.get(LAYOUT_FLAG):
        return read_layout(flags[LAYOUT_FLAG], pp * vpp)
    if num_layers is None or pp * vpp == 1:
        return None
    first, last = get("--decoder-first-pipeline-num-layers", None), get("--decoder-last-pipeline-num-layers", None)
    counts = even_counts(num_layers, pp * vpp, first, last)
    if counts is None:
        raise MeshplanError(f"Megatron-LM cannot split {num_layers} layers over {pp * vpp} pipeline chunks with first "
                            f"{first} and last {last}; the remaining layers must divide evenly")
    return counts


def expand_layout(text: str) -> str:
    """A layout with its `X*n` and `(...)*n` repeats written out (innermost first)."""
    expanded = text.replace(" ", "").strip("\"'")
    for _ in range(100):
        step = re.sub(r"\(([^()]*)\)\*(\d+)|([A-Za-z])\*(\d+)",
                      lambda m: (m.group(1) or m.group(3)) * int(m.group(2) or m.group(4)), expanded)
        if step == expanded:
            break
        expanded = step
    return expanded


def read_layout(text: str, chunks: int) -> tuple[int, ...]:
    """Layers per chunk of a `--pipeline-model-parallel-layout` (`X*n` and `(...)*n` repeats expanded)."""
    expanded = expand_layout(text)
    parts = expanded.split("|")
    if len(parts) != chunks or any(set(part) - set("EtLm") for part in parts):
        raise MeshplanError(f"{LAYOUT_FLAG} {text!r}: expected {chunks} stages of E, t, m and L separated by |; "
                            "give it as Megatron-LM does")
    if "m" in "".join(parts[:-1]):
        raise MeshplanError(f"{LAYOUT_FLAG} {text!r}: multi-token prediction layers (m) before the last stage; "
                            "meshplan places them with the output layer, as Megatron-Core does without a layout")
    return tuple(part.count("t") + part.count("E") + part.count("L") for part in parts)
