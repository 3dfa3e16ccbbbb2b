"""Which of a block's Linears run in fp8 (`ParallelConfig.fp8_filter`), one rule for the cost model.

torchao converts Linears to fp8 one module at a time (`convert_to_float8_training`'s
`module_filter_fn`; torchtitan's [float8] `filter_fqns`), so a configuration may leave some in
bf16: those a user names (`FP8_LINEARS` roles), those torchao's auto filter finds too small for the
recipe ("auto": `AUTO_FILTER_RULES`, torchtitan's "auto_filter_small_kn"), and always those with a
dimension that is not a multiple of 16, which fp8 tensor cores need (torchao's filters and
torchtitan's `module_filter_fn` skip them). `planner.costing.fp8` prices a block's fp8 Linears
from `Fp8Linears`: their GEMMs and casts, their saved fp8 inputs, their fp8 weight copies and
gathers; the rest run as bf16 Linears.

Where the shapes of a block's Linears are not known (`gemm.block_linear_shapes` is empty: traced
models; a MoE block's are its dense part's, `expert_parallel.dense_part`), every block Linear is
priced in fp8, and `fp8_advice.filter_problem` refuses a filter rather than ignore it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.fp8_choice import FP8_AUTO_FILTER, FP8_LINEARS
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import gemm
from meshplan.planner.costing.device_time import infer_seq

# fp8 GEMMs need every dimension a multiple of 16 (torchao float8_linear_utils.py's filters).
FP8_DIM_MULTIPLE = 16
# torchao's auto filter (torchao/float8/float8_linear_utils.py, `_auto_filter_for_tensorwise` and
# `_auto_filter_for_rowwise`, from its H100 Linear benchmarks): whether a weight of N output and
# K input features (before TP) stays bf16 under the recipe.
AUTO_FILTER_RULES = {
    "tensorwise": lambda n, k: k <= 4096 and n <= 1024,
    "rowwise": lambda n, k: n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048),
}


def linear_roles(shapes) -> tuple[str, ...]:
    """The role of each of `gemm.block_linear_shapes`' Linears: attention's four, then the MLP's
    (gate, up, down with two column Linears; up, down with one)."""
    mlp = shapes[4:]
    return FP8_LINEARS[:4] + (FP8_LINEARS[4:] if len(mlp) == 3 else FP8_LINEARS[5:])[:len(mlp)]


@dataclass(frozen=True)
class Fp8Linears:
    """A block's Linears (`gemm.block_linear_shapes`: (in, out, column), before TP) and which run
    in fp8. `shapes` () when unknown: every Linear then counts as fp8 (the shares are 1)."""

    shapes: tuple[tuple[int, int, bool], ...]
    in_fp8: tuple[bool, ...]
    dense_mlp: bool = True

    def __post_init__(self):
        if len(self.shapes) != len(self.in_fp8):
            raise ValueError(f"{len(self.shapes)} Linear shapes but {len(self.in_fp8)} fp8 choices")

    @property
    def everything(self) -> bool:
        return all(self.in_fp8)

    @property
    def fp8_shapes(self) -> tuple:
        return tuple(shape for shape, chosen in zip(self.shapes, self.in_fp8) if chosen)

    @property
    def bf16_shapes(self) -> tuple:
        return tuple(shape for shape, chosen in zip(self.shapes, self.in_fp8) if not chosen)

    def _share(self, weight, picked=lambda index: True) -> float:
        total = chosen = 0.0
        for index, (shape, fp8) in enumerate(zip(self.shapes, self.in_fp8)):
            if picked(index):
                total += weight(shape)
                chosen += weight(shape) if fp8 else 0.0
        return chosen / total if total else 1.0

    @property
    def param_share(self) -> float:
        """The fp8 Linears' share of the block's Linear parameters."""
        return self._share(lambda shape: shape[0] * shape[1])

    def _regions(self) -> list[tuple[bool, ...]]:
        """The fp8 choices of each region's column Linears, which read one input: attention's q, k,
        v and, in a dense block, the MLP's gate and up (or up)."""
        return [self.in_fp8[:3]] + ([self.in_fp8[4:-1]] if self.dense_mlp and len(self.shapes) > 4 else [])

    @property
    def replicated_share(self) -> float:
        """The share of the regions whose gathered input some fp8 Linear casts: attention's q, k,
        v and, in a dense block, the MLP's column Linears (`fp8.linear_input_bytes`' replicated)."""
        if not self.shapes:
            return 1.0
        regions = self._regions()
        return sum(any(region) for region in regions) / len(regions)

    @property
    def column_linears_per_region(self) -> float:
        """The fp8 column Linears per region that has one: how many casts of that region's input
        eager torchao makes (`fp8_eager.column_casts_per_region`)."""
        counts = [sum(region) for region in self._regions() if any(region)] if self.shapes else []
        return sum(counts) / len(counts) if counts else 1.0

    @property
    def sharded_share(self) -> float:
        """The fp8 row Linears' share of the row Linears' input values: o's and, in a dense block,
        down's (`fp8.linear_input_bytes`' sharded)."""
        rows = (3, len(self.shapes) - 1) if self.dense_mlp and len(self.shapes) > 4 else (3,)
        return self._share(lambda shape: shape[0], lambda index: index in rows)

    @property
    def num_fp8(self) -> int:
        return sum(self.in_fp8)


def input_regions(layer: LayerProfile) -> int:
    """The regions of a block whose column Linears read one input: attention's, and a dense MLP's
    (its row Linears' count, `num_allreduce_per_pass`); a MoE block's MLP is grouped experts."""
    return layer.tp_split.num_allreduce_per_pass if layer.expert_params == 0 else 1


@lru_cache(maxsize=4096)
def _choices(shapes: tuple, names: tuple[str, ...], recipe: str | None) -> tuple[bool, ...]:
    auto = AUTO_FILTER_RULES.get(recipe) if FP8_AUTO_FILTER in names else None
    return tuple(role not in names and in_dim % FP8_DIM_MULTIPLE == 0 and out_dim % FP8_DIM_MULTIPLE == 0
                 and not (auto and auto(out_dim, in_dim))
                 for role, (in_dim, out_dim, _) in zip(linear_roles(shapes), shapes))


def fp8_linears(layer: LayerProfile, info: ModelInfo, config: ParallelConfig, profile_dtype: str) -> Fp8Linears:
    """Which of `layer`'s Linears run in fp8 under `config` (profile taken in `profile_dtype`)."""
    shapes = gemm.block_linear_shapes(layer, info, infer_seq(layer, info, profile_dtype))
    return Fp8Linears(shapes, _choices(shapes, config.fp8_filter, config.fp8_recipe), layer.expert_params == 0)

