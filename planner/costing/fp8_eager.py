"""torchao's Float8Linear run eagerly: torchtitan's float8 converter without torch.compile.

`planner.costing.fp8` prices a block's casts as a compiled or fused stack runs them: one cast of
each region's input shared by its column Linears (Transformer Engine's fused linear_qkv and
linear_fc1 under Megatron-Core; under torch.compile, AOTAutograd's common-subexpression pass
merges the q, k and v Linears' identical casts of one tensor), both fp8 layouts written at once,
and the fp8 copy saved for the backward. torchtitan keeps q, k, v and the MLP's gate and up as
separate Linears (wq, wk, wv, w1, w3), and eagerly torchao's Float8Linear
(torchao/float8/float8_linear.py, `matmul_with_hp_or_float8_args`) does none of that:

- forward, each Linear casts its own input: an amax pass (reads bf16) and a cast kernel (reads
  bf16, writes fp8), so q, k and v each cast the region's gathered norm output;
- it saves that input in bf16 (the saved tensor is the bf16 input itself) and casts it again in
  backward, in the other layout, for its weight gradient;
- backward, its output gradient is cast once per gradient GEMM (the input gradient's layout and
  the weight gradient's), each cast its own amax pass and kernel.

So every activation cast costs `CAST_BYTES_PER_VALUE`, inputs twice per Linear and output
gradients twice; weights are priced as the recipe prices them. (torchtitan's memory already keeps
the Linears' inputs in bf16, compiled or not: `engine_memory`.) tests/planner/costing/test_fp8_eager.py counts these casts and
saved tensors in torchao itself, eagerly and under AOTAutograd. Not applied to layers whose
inputs torchtitan's Float8 TP plan casts before its all-gathers (`fp8.fp8_tp_gather`): there one
cast on the sequence shard feeds every column Linear.
"""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.engine_rules import runs_compiled
from meshplan.planner.contracts.graph import LayerProfile
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.fp8_filter import Fp8Linears, input_regions

# The recipes torchtitan runs through torchao's Float8Linear.
FLOAT8_LINEAR_RECIPES = ("tensorwise", "rowwise")
EAGER_FLOAT8_ENGINES = ("torchtitan",)
# One eager cast: the amax pass reads bf16 (2 bytes), the cast kernel reads it again and writes fp8 (1).
CAST_BYTES_PER_VALUE = 2 * 2.0 + 1.0
# Casts per tensor per micro-batch: an input forward and again backward; an output gradient per gradient GEMM.
CASTS_PER_INPUT = CASTS_PER_OUTPUT_GRADIENT = 2


def casts_eagerly(config: ParallelConfig) -> bool:
    """Whether the configuration's fp8 Linears are torchao Float8Linears run without torch.compile."""
    return (config.precision == "fp8" and config.engine in EAGER_FLOAT8_ENGINES
            and config.fp8_recipe in FLOAT8_LINEAR_RECIPES and not runs_compiled(config))


def column_casts_per_region(layer: LayerProfile, linears: Fp8Linears) -> float:
    """How many times, eagerly, each region's input is cast: the fp8 column Linears of the regions
    that have one (q, k, v; in a dense block the MLP's gate and up), per such region. A block
    whose Linear shapes are unknown counts its profile's column Linears over its regions."""
    if linears.shapes:
        return linears.column_linears_per_region
    return max(1.0, len(layer.tp_split.column_linears) / max(1, input_regions(layer)))


def activation_cast_times_s(inputs: float, output_gradients: float, cluster: ClusterProfile) -> tuple[float, float]:
    """(forward, backward) seconds of a micro-batch's eager activation casts: `inputs` values cast
    once forward and once backward, `output_gradients` twice backward."""
    forward = inputs * CAST_BYTES_PER_VALUE
    backward = (inputs * (CASTS_PER_INPUT - 1) + output_gradients * CASTS_PER_OUTPUT_GRADIENT) * CAST_BYTES_PER_VALUE
    return memory_time_s(forward, cluster), memory_time_s(backward, cluster)
