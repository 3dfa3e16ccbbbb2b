"""`EngineJob`: one training configuration in engine-neutral terms, and the facts of a Plan the
engines need (layers per pipeline chunk, recomputation per transformer block).

Layer counts are over meshplan's layers in execution order, the embedding and the head included
(`embed`, `blocks.0` ... `blocks.N-1`, `head` for zoo models); chunk c runs on pipeline rank
c mod pp (see `contracts.plan`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from meshplan.planner.contracts.axes import AXIS_NAMES, degrees_base
from meshplan.planner.contracts.config import (CP_METHODS, DEFAULT_CP_METHOD, DEFAULT_MOE_DISPATCHER, MOE_DISPATCHERS,
                                               OFFLOAD, PRECISIONS, RECOMPUTE, SCHEDULES)
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import MTP_LAYER_PREFIX
from meshplan.planner.engines import ENGINES

NON_BLOCK_LAYERS = ("embed", "head")


# Every axis's degree defaults to 1, but dp: None, gpus / (the other mesh degrees).
# dp None: gpus / the others; etp None: the experts split as the dense layers (tp), as ParallelConfig
_JobDegrees = degrees_base("JobDegrees", lambda axis: None if axis.name in ("dp", "etp") else 1)


@dataclass(frozen=True, kw_only=True)
class EngineJob(_JobDegrees):
    """What an engine's config fixes, in meshplan's terms (None: the config leaves it open): a
    degree per axis of `contracts.axes` (tp, pp, dp, cp, ep; dp None: gpus / (tp * pp * cp))
    and the fields below."""

    engine: str  # which engine the config is for; also names the memory recipe (`costing.engine_memory`)
    model: str | None = None  # meshplan model SPEC (from the engine's flavour or model shape)
    seq: int | None = None  # tokens per sample
    gpus: int | None = None  # world size
    global_batch: int | None = None  # samples per optimizer step
    microbatch_size: int = 1  # samples per micro-batch on one data-parallel rank
    zero: int = 0
    shard_group: int | None = None  # HSDP: ZeRO within groups of this many dp ranks, replicated across
    sp: bool = False
    cp_method: str = DEFAULT_CP_METHOD  # how CP ranks attend (Megatron-LM's --cp-comm-type a2a, DeepSpeed: ulysses)
    recompute: str = "none"  # of every transformer block, unless one of the two rules below applies
    recompute_every: int = 1  # full recomputation of every N-th block only (torchtitan's layer SAC)
    recompute_first_per_chunk: int | None = None  # full recomputation of the first N blocks of each chunk
    recompute_modules: tuple[str, ...] = ()  # Megatron-Core's --recompute-modules under selective; (): core_attn
    schedule: str = "1f1b"
    vpp: int = 1  # virtual stages per pipeline rank
    # interleaved 1F1B's micro-batches per round (Megatron-Core's group size per virtual stage); None: pp
    microbatch_group_size: int | None = None
    grad_reduce_in_bf16: bool = False  # Megatron-LM's --grad-reduce-in-bf16: a bf16 gradient buffer
    # TP collectives pipelined with their GEMMs (Megatron-LM's --tp-comm-overlap, torchtitan's async
    # TP); None: the engine's record (`ParallelConfig.tp_comm_overlap`)
    tp_comm_overlap: bool | None = None
    moe_a2a_overlap: bool = False  # Megatron-LM's --overlap-moe-expert-parallel-comm (combined 1F1B)
    # torch's checkpoint early stop under full recomputation; None: the engine's rule
    # (`ParallelConfig.recompute_early_stop`; no engine config says it, the command line may)
    recompute_early_stop: bool | None = None
    torch_compile: bool = False  # torch.compile of the model (torchtitan's training.compile)
    compile_loss: bool | None = None  # torch.compile of the loss; None: with the model (`ParallelConfig.compile_loss`)
    cross_entropy_fusion: str = "none"  # Megatron-LM's --cross-entropy-loss-fusion (and -impl te): `costing.loss_kernels`
    precision: str | None = None  # None: the cluster's default
    fp8_recipe: str | None = None  # under fp8 (contracts.config.FP8_RECIPES); None: the engine's default
    fp8_filter: tuple[str, ...] = ()  # under fp8, the block Linears left in bf16 (`contracts.fp8_choice`)
    layers_per_chunk: tuple[int, ...] | None = None  # None: balanced by the cost model (or uniform_split)
    uniform_split: bool = False  # equal layer counts per chunk, the remainder on the last (DeepSpeed "uniform")
    offload: str = "none"  # model states in host memory (contracts.config.OFFLOAD; `costing.offload`)
    moe_dispatcher: str = DEFAULT_MOE_DISPATCHER  # MoE token dispatcher (contracts.config.MOE_DISPATCHERS)
    mtp_num_layers: int = 0  # multi-token-prediction depths (Megatron-LM's --mtp-num-layers; `profiling.mtp`)
    notes: tuple[str, ...] = ()  # what the config holds that meshplan did not map, one line each

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise MeshplanError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        degrees = tuple(name for name in AXIS_NAMES if name not in ("dp", "etp"))
        for name in ("microbatch_size", *degrees, "vpp", "recompute_every"):
            _positive(name, getattr(self, name))
        for name in ("seq", "gpus", "global_batch", "dp", "etp", "shard_group", "microbatch_group_size"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.zero not in (0, 1, 2, 3):
            raise MeshplanError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in RECOMPUTE:
            raise MeshplanError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.schedule not in SCHEDULES:
            raise MeshplanError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.offload not in OFFLOAD or (self.offload == "params" and self.zero != 3):
            raise MeshplanError(f"offload must be one of {', '.join(OFFLOAD)} (params with ZeRO-3 only), got "
                                f"{self.offload!r} at ZeRO-{self.zero}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise MeshplanError(f"moe_dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, got {self.moe_dispatcher!r}")
        if self.cp_method not in CP_METHODS:
            raise MeshplanError(f"cp_method must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise MeshplanError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.recompute_first_per_chunk is not None and self.recompute_first_per_chunk < 0:
            raise MeshplanError(f"recomputed blocks per chunk must be >= 0, got {self.recompute_first_per_chunk}")
        if self.layers_per_chunk is not None:
            if len(self.layers_per_chunk) != self.pp * self.vpp or min(self.layers_per_chunk) <= 0:
                raise MeshplanError(f"layers per pipeline chunk {list(self.layers_per_chunk)} must be "
                                    f"{self.pp * self.vpp} positive counts (pp {self.pp} x virtual stages {self.vpp})")

    def world_size(self) -> int | None:
        """GPUs the config fixes: stated, or the product of its degrees when dp is stated."""
        if self.gpus is not None:
            return self.gpus
        if self.dp is not None:
            return self.dp * self.tp * self.pp * self.cp
        return None


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MeshplanError(f"{name} must be a positive integer, got {value!r}")


def layers_per_chunk(plan) -> tuple[int, ...]:
    """Layers in each pipeline chunk of a plan, in chunk order."""
    return tuple(len(chunk) for chunk in plan.chunks())


def is_block_name(name: str) -> bool:
    """Whether a layer of that name is one of the decoder's transformer blocks: not the embedding,
    the head or a multi-token-prediction depth (which the engines count apart)."""
    return name not in NON_BLOCK_LAYERS and not name.startswith(MTP_LAYER_PREFIX)


def block_indices(names) -> list[int]:
    """Positions of the decoder's transformer blocks (`is_block_name`)."""
    return [i for i, name in enumerate(names) if is_block_name(name)]


def blocks_per_chunk(plan) -> list[int]:
    """The decoder's transformer blocks in each pipeline chunk of a plan."""
    return [sum(is_block_name(plan.layers[i].name) for i in chunk) for chunk in plan.chunks()]


def block_recompute(plan) -> list[str]:
    """Recomputation of every decoder block of a plan, in execution order."""
    return [layer.recompute for layer in plan.layers if is_block_name(layer.name)]


def dominant_recompute(modes: list[str]) -> str:
    """The most common mode (ties: the one that saves more memory)."""
    if not modes:
        return "none"
    counts = Counter(modes)
    return max(RECOMPUTE, key=lambda mode: (counts[mode], RECOMPUTE.index(mode)))


def every_nth_full(modes: list[str]) -> int | None:
    """N when exactly every N-th block (1-based: blocks N, 2N, ...) is fully recomputed, the rest not."""
    full = [i + 1 for i, mode in enumerate(modes) if mode == "full"]
    if not full or any(mode == "selective" for mode in modes):
        return None
    step = full[0]
    if full == list(range(step, len(modes) + 1, step)):
        return step
    return None


def first_n_full_per_chunk(plan) -> int | None:
    """N when every chunk fully recomputes exactly its first N blocks and no other (Megatron's
    `--recompute-method block`); None otherwise."""
    counts = set()
    for chunk in plan.chunks():
        modes = [plan.layers[i].recompute for i in chunk if is_block_name(plan.layers[i].name)]
        head = len([m for m in _prefix(modes, "full")])
        if any(mode != "none" for mode in modes[head:]):
            return None
        counts.add(head)
    return counts.pop() if len(counts) == 1 else None


def _prefix(modes: list[str], mode: str) -> list[str]:
    out = []
    for item in modes:
        if item != mode:
            break
        out.append(item)
    return out


def resolve_recompute(job: EngineJob, names, chunk_of_layer) -> tuple[str, ...]:
    """Recomputation of every layer of a model with these layer names under a job's rule:
    the embedding and the head never recompute."""
    blocks = set(block_indices(names))
    out = []
    block_number, position_in_chunk, previous_chunk = 0, 0, None
    for index, chunk in enumerate(chunk_of_layer):
        if index not in blocks:
            out.append("none")
            continue
        position_in_chunk = position_in_chunk + 1 if chunk == previous_chunk else 0
        previous_chunk = chunk
        block_number += 1
        if job.recompute_first_per_chunk is not None:
            out.append("full" if position_in_chunk < job.recompute_first_per_chunk else "none")
        elif job.recompute == "full" and job.recompute_every > 1:
            out.append("full" if block_number % job.recompute_every == 0 else "none")
        else:
            out.append(job.recompute)
    return tuple(out)


def chunks_from_counts(counts, num_layers: int) -> tuple[int, ...]:
    """Chunk index of every layer from layers per chunk; the counts must cover the model."""
    if sum(counts) != num_layers:
        raise MeshplanError(f"the config places {sum(counts)} layers in its pipeline chunks ({list(counts)}) but "
                            f"the model has {num_layers} (embedding and head included); check the model or "
                            "the pipeline split")
    return tuple(chunk for chunk, count in enumerate(counts) for _ in range(count))
