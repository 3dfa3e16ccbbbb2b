"""The transposed fp8 copies after torchtitan's Float8 TP all-gathers.

Hopper's fp8 GEMM (`torch._scaled_mm`) takes its first operand row-major and its second
column-major. torchao's Float8 Linear makes the layout an operand lacks with a copy just before the
GEMM (torchao/float8/float8_ops.py, `preprocess_addmm`: `a.contiguous()` where the first operand is
not row-major, `b.t().contiguous().t()` where the second is). A cast from bf16 writes both layouts
as it quantises, which the recipes' bytes count (`fp8.Fp8Recipe`).

Under torchtitan's Float8 TP plan (`fp8.fp8_tp_gather`) the cast runs on the rank's sequence shard
before the all-gather and writes one layout (torchao/float8/float8_tensor_parallel.py: the plan's
`hp_tensor_to_float8_dynamic`, then `redistribute`). The Linear saves the gathered fp8 tensor as
its input and reuses it in backward without a fresh cast (`float8_linear.py`,
`matmul_with_hp_or_float8_args`: `tensor_already_casted_to_fp8`). Its weight gradient
dW = dY^T X takes X as the second operand, column-major, so the gathered row-major input is
copied whole. Likewise the row Linears' output gradients, cast on the shard before the backward's
all-gather: dY^T as the first operand, row-major. A byte read and a byte written per gathered
value, in the backward, on the compute stream. A collective produced the tensor, so no cast
kernel takes the copy in, as `fp8.collective_cast_values` says of casts; it is priced apart from
DTensor's re-concatenation of the same gather (`sp_layout`), which, where Inductor writes both
layouts from one read in one graph, would save a byte a value (not priced). Against what the
recipe's bytes count, the shard's casts write one layout fewer.
"""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.gemm import DTYPE_BYTES

FP8_VALUE_BYTES = DTYPE_BYTES["fp8"]


def gathered_transpose_times_s(inputs: float, grads: float, tp: int, cluster: ClusterProfile) -> tuple[float, float]:
    """(forward, backward) seconds one micro-batch's layouts add under the Float8 TP plan, beyond
    the recipe's casts: the gathered `inputs` (the column Linears') and output `grads` (the row
    Linears') copied into their transposed layout in backward (a read and a write each), less the
    second layout the shard casts do not write (1/tp of each: inputs forward, gradients backward).
    Negative forward: the recipe's bytes over-count the shard's cast."""
    forward = -FP8_VALUE_BYTES * inputs / tp
    backward = 2 * FP8_VALUE_BYTES * (inputs + grads) - FP8_VALUE_BYTES * grads / tp
    return memory_time_s(forward, cluster), memory_time_s(backward, cluster)
