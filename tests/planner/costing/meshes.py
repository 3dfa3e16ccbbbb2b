"""`mesh`: the `ParallelConfig` a cost-model test prices a layer under, from the degrees and switches alone."""
from meshplan.planner.contracts.config import ParallelConfig


def mesh(*, tp: int = 1, dp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, microbatch_size: int = 1,
         **switches) -> ParallelConfig:
    """These degrees and switches (zero, recompute, sp, precision, shard_group) on as many GPUs as
    the degrees multiply to, one micro-batch per pipeline stage (a layer's cost reads neither)."""
    return ParallelConfig(gpus=tp * dp * pp * cp, global_batch=dp * microbatch_size * pp, tp=tp, dp=dp, pp=pp,
                          cp=cp, ep=ep, microbatch_size=microbatch_size, **switches)
