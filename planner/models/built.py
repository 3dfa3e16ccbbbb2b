"""What building a model yields: the module and what the profiler and executor need to drive it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from meshplan.planner.contracts.graph import ModelInfo, TPSplit
from meshplan.planner.models.config import TransformerConfig

# More blocks than any published model by far; beyond it the per-layer graph alone would not fit
# in memory, so such a spec is refused rather than left to fail with a MemoryError.
MAX_PARAMETRIC_LAYERS = 100_000


@dataclass(frozen=True)
class BuiltModel:
    """A constructed module plus what the profiler and executor need to drive it."""

    module: Any  # torch.nn.Module
    example_inputs: tuple  # one sample (batch dimension 1)
    info: ModelInfo
    layer_modules: tuple[tuple[str, str, Any], ...]  # (name, kind, module) in execution order
    loss_fn: Callable | None = None  # loss_fn(output, inputs) -> scalar; None: cannot train
    config: TransformerConfig | None = None  # zoo models only
    targets: Any = None  # zoo: next-token targets for the example tokens
    # forward_fn(module, example_inputs) -> output; None: module(*example_inputs).
    forward_fn: Callable | None = None
    # What the profiler measures, in execution order; empty: one group per layer_modules entry
    # (file models: the profiler chooses the grouping).
    layer_groups: tuple[LayerGroup, ...] = ()

    def run_forward(self):
        """The model's output for its example inputs (what `loss_fn` takes)."""
        if self.forward_fn is not None:
            return self.forward_fn(self.module, self.example_inputs)
        return self.module(*self.example_inputs)


@dataclass(frozen=True)
class LayerGroup:
    """One layer as the profiler sees it: the modules whose calls make it up, in call order.

    The layer starts when its first module is called and lasts until the next layer's first
    module is called, so glue between modules (residual adds, the loss after the head) counts
    in the layer that ran last. `tp_split` names its Linears relative to `modules[0]`, and
    `expert_modules` the routed experts of a mixture-of-experts block (called with the dispatched
    tokens, returning the expert outputs), whose share of the figures the profiler also records.
    """

    name: str
    kind: str
    modules: tuple[Any, ...]
    tp_split: TPSplit = field(default_factory=TPSplit)
    expert_modules: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.modules:
            raise ValueError(f"layer group {self.name!r} has no modules")


@dataclass(frozen=True)
class ProfileModel:
    """A model built for profiling: distinct layers only, and the full layer layout they expand to.

    `layout` lists every layer of the real model as (name, kind, measured group name), e.g.
    ("blocks.7", "block", "blocks.0") when all blocks share one structure; empty when every
    layer is measured (file models, whose grouping the profiler chooses).
    """

    built: BuiltModel
    layout: tuple[tuple[str, str, str], ...]
