"""The registry of parallel axes: every degree a `ParallelConfig` carries, named once.

The device mesh is (pp, dp, cp, tp), tp innermost: a tensor-parallel group is `tp` consecutive
ranks, a context-parallel group `cp` ranks `tp` apart, a data-parallel group `dp` ranks `cp * tp`
apart, pipeline neighbours `dp * cp * tp` ranks apart (`MESH_AXES`; their degrees multiply to the
GPU count). The MoE layers are folded (Megatron-Core's MoE parallel folding): they lay their own
(edp, ep, etp) over the same tp * cp * dp ranks of a pipeline stage, etp innermost. An
expert-tensor-parallel group is `etp` consecutive ranks, an expert-parallel group `ep` ranks `etp`
apart, and the ranks that hold the same expert shards (expert data parallelism, edp =
tp * cp * dp / (etp * ep)) are `etp * ep` apart. etp unset follows tp (Megatron-LM's default), and
then an expert-parallel group is `ep` consecutive data ranks, `tp` apart, as before folding.

What each consumer needs of an axis lives here: the `ParallelConfig` field (also the plan.json
`mesh` key), the CLI flag, the label text, the tie-break rank of the search, and the mesh rule it
obeys. Model rules (tp divides the heads, ep the experts) and cluster rules (tp within a node)
belong to the cost model and the search, which know the model and the cluster.
"""
from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Callable


@dataclass(frozen=True)
class Axis:
    """One parallel axis.

    `name` is the `ParallelConfig` field and the plan.json `mesh` key; `flag` the CLI option of
    `estimate` and `plan`, `help` its help text; `title` the words a report or an error uses. A mesh axis
    (`multiplies_gpus`) has a place in the mesh order; a folded axis is carved out of the ranks
    `ParallelConfig.<carved_from>` counts and must divide them. `optional`: added after the first
    plan schema, so plan.json's `mesh` and `label()` show it only when it is on (> 1), and a plan
    without it reads as 1; an axis that `follows` a mesh axis is unset (None) unless given, takes
    that axis's degree then, and is shown only when set. `tie_break`: the search prefers a smaller degree of a lower-ranked axis
    first (`ParallelConfig.sort_key`).
    """

    name: str
    flag: str
    title: str
    multiplies_gpus: bool
    optional: bool
    tie_break: int
    help: str
    carved_from: str | None = None  # a ParallelConfig property naming the ranks a folded axis splits
    follows: str | None = None  # the mesh axis whose degree an unset (None) folded axis takes

    def __post_init__(self):
        if self.multiplies_gpus == (self.carved_from is not None):
            raise ValueError(f"axis {self.name!r}: a mesh axis multiplies the GPUs, a folded one is carved out "
                             f"of others' ranks (multiplies_gpus={self.multiplies_gpus}, "
                             f"carved_from={self.carved_from!r})")
        if self.flag != f"--{self.name}":
            raise ValueError(f"axis {self.name!r}: its CLI flag must be --{self.name}, got {self.flag!r}")
        if self.follows is not None and (self.multiplies_gpus or not self.optional):
            raise ValueError(f"axis {self.name!r}: only an optional folded axis can follow {self.follows!r}")

    def check(self, config) -> None:
        """ValueError unless this axis's degree in `config` is a positive integer that fits the mesh."""
        degree = getattr(config, self.name)
        if degree is None and self.follows is not None:
            degree = getattr(config, self.follows)
        if isinstance(degree, bool) or not isinstance(degree, int) or degree <= 0:
            raise ValueError(f"{self.name} must be a positive integer, got {degree!r}")
        if self.carved_from is not None:
            ranks = getattr(config, self.carved_from)
            if ranks % degree:
                ranks_text = self.carved_from.replace("_", " ")
                raise ValueError(f"{self.title} {self.name}={degree} must divide the {ranks_text} "
                                 f"{CARVED_FROM_TEXT[self.carved_from](config)}")

    def shown(self, degrees) -> bool:
        """Whether plan.json's `mesh` and labels show this axis, given `degrees` (a ParallelConfig
        or a plan's mesh table): always a first-schema axis; an optional one when on (> 1); one
        that follows another when set."""
        value = degrees.get(self.name) if isinstance(degrees, dict) else getattr(degrees, self.name)
        if self.follows is not None:
            return value is not None
        return not self.optional or (value or 1) > 1


# Outermost first. tp innermost keeps tensor-parallel groups inside a node.
MESH_AXES: tuple[Axis, ...] = (
    Axis("pp", "--pp", "pipeline parallelism", multiplies_gpus=True, optional=False, tie_break=0,
         help="pipeline-parallel degree"),
    Axis("dp", "--dp", "data parallelism", multiplies_gpus=True, optional=False, tie_break=3,
         help="data-parallel degree"),
    Axis("cp", "--cp", "context parallelism", multiplies_gpus=True, optional=True, tie_break=2,
         help="context-parallel degree: each of cp ranks holds 1/cp of every sequence"),
    Axis("tp", "--tp", "tensor parallelism", multiplies_gpus=True, optional=False, tie_break=1,
         help="tensor-parallel degree (inside one node)"),
)
# Carved out of the mesh axes' ranks, multiplying nothing; checked in this order (ep's ranks need etp).
FOLDED_AXES: tuple[Axis, ...] = (
    Axis("etp", "--etp", "expert tensor parallelism", multiplies_gpus=False, optional=True, tie_break=5,
         help="expert tensor-parallel degree (mixtures of experts): every routed expert split over etp "
              "consecutive ranks of a pipeline stage; default: --tp",
         carved_from="stage_ranks", follows="tp"),
    Axis("ep", "--ep", "expert parallelism", multiplies_gpus=False, optional=True, tie_break=4,
         help="expert-parallel degree (mixtures of experts): routed experts split over ep ranks etp apart; "
              "ep*etp divides the tp*cp*dp ranks of a stage, ep the expert count",
         carved_from="expert_ranks"),
)
AXES: tuple[Axis, ...] = MESH_AXES + FOLDED_AXES
AXIS_NAMES: tuple[str, ...] = tuple(axis.name for axis in AXES)
MESH_AXIS_NAMES: tuple[str, ...] = tuple(axis.name for axis in MESH_AXES)
# The ranks a `carved_from` property counts, with the numbers (for error messages).
CARVED_FROM_TEXT = {
    "stage_ranks": lambda config: mesh_product_text(config, ("dp", "cp", "tp")),
    "expert_ranks": lambda config: (f"dp*cp*tp/etp = {config.dp}*{config.cp}*{config.tp}/{config.expert_tp} = "
                                    f"{config.expert_ranks}"),
}


def degrees_base(class_name: str, default: Callable[[Axis], int | None]) -> type:
    """A frozen, keyword-only dataclass with one degree field per registered axis (`default(axis)`
    its default), in registry order: the base of the classes that carry a degree per axis beside
    other fields (`search.candidates.Pins`, `engines.job.EngineJob`), so a new axis is a field
    of theirs without an edit to them."""
    return make_dataclass(class_name, [(a.name, "int | None", field(default=default(a))) for a in AXES],
                          frozen=True, kw_only=True)


def axis(name: str) -> Axis:
    """The registered axis called `name`."""
    for candidate in AXES:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown parallel axis {name!r}; the axes are {', '.join(AXIS_NAMES)}")


def mesh_product_text(config, names: tuple[str, ...] = MESH_AXIS_NAMES) -> str:
    """'dp*cp = 4*2 = 8': a product of degrees, with the numbers, for error messages."""
    degrees = [getattr(config, name) for name in names]
    product = 1
    for degree in degrees:
        product *= degree
    return f"{'*'.join(names)} = {'*'.join(map(str, degrees))} = {product}"


def mesh_stride(config, name: str) -> int:
    """Ranks between neighbours of a mesh axis's group: the product of the axes inside it."""
    names = MESH_AXIS_NAMES
    if name not in names:
        raise ValueError(f"{name!r} is not a mesh axis; the mesh is ({', '.join(names)})")
    stride = 1
    for inner in names[names.index(name) + 1:]:
        stride *= getattr(config, inner)
    return stride
