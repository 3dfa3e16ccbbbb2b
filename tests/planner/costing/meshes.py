"""`mesh`: the `ParallelConfig` a cost-model test prices a layer under, from the degrees and switches
alone; the small mixture of experts the expert-parallel tests price (`small_moe_graph`,
`expert_block`, `expert_block_cost`)."""
from functools import lru_cache

from meshplan.planner.contracts.config import ParallelConfig


def mesh(*, tp: int = 1, dp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, microbatch_size: int = 1,
         **switches) -> ParallelConfig:
    """These degrees and switches (zero, recompute, sp, precision, shard_group) on as many GPUs as
    the degrees multiply to, one micro-batch per pipeline stage (a layer's cost reads neither)."""
    return ParallelConfig(gpus=tp * dp * pp * cp, global_batch=dp * microbatch_size * pp, tp=tp, dp=dp, pp=pp,
                          cp=cp, ep=ep, microbatch_size=microbatch_size, **switches)


# A 4-block mixture of experts small enough to profile in a second.
SEQ, HIDDEN, EXPERTS, TOP_K, EXPERT_FFN = 1024, 512, 16, 2, 256
SMALL_MOE = (f"moe:layers=4,hidden={HIDDEN},heads=8,kv_heads=4,experts={EXPERTS},top_k={TOP_K},"
             f"expert_ffn={EXPERT_FFN},vocab=8000")


@lru_cache(maxsize=1)
def small_moe_graph():
    from meshplan.planner.profiling.profiler import profile

    return profile(SMALL_MOE, SEQ, dtype="bf16")


def expert_block(graph):
    """The graph's first block with routed experts."""
    return next(layer for layer in graph.layers if layer.expert_params)


def expert_block_cost(graph, info=None, **degrees):
    """`layer_cost` of the first expert block on h100-sxm under `mesh(**degrees)`."""
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.costing.layer_cost import layer_cost

    return layer_cost(expert_block(graph), mesh(**degrees), load_cluster("h100-sxm"), info or graph.info,
                      profile_dtype="bf16")
