"""Hand-written plans: a uniform `Plan` for a mesh, without the solver (tests, benchmarks, notebooks)."""
from __future__ import annotations

from meshplan.planner.contracts.config import DEFAULT_CP_METHOD, ParallelConfig
from meshplan.planner.contracts.plan import LayerAssignment, ModelRef, Plan


def uniform_plan(spec: str, seq: int, global_batch: int, cluster, *, tp: int = 1, pp: int = 1, dp: int = 1,
                 microbatch_size: int = 1, zero: int = 0, schedule: str = "1f1b", virtual_stages: int = 1,
                 recompute: str = "none", sp: bool = False, precision: str = "fp32", seed: int = 0,
                 shard_group: int | None = None, cp: int = 1, ep: int = 1, etp: int | None = None,
                 cp_method: str = DEFAULT_CP_METHOD) -> Plan:
    """Layers cut into pp * virtual_stages contiguous chunks of near-equal size (earlier chunks
    take the remainder), every layer with the same recomputation."""
    from meshplan.planner.models.registry import build_model

    config = ParallelConfig(gpus=tp * pp * dp * cp, global_batch=global_batch, tp=tp, pp=pp, dp=dp, cp=cp,
                            microbatch_size=microbatch_size, zero=zero, recompute=recompute, sp=sp,
                            schedule=schedule, virtual_stages=virtual_stages, precision=precision,
                            shard_group=shard_group, ep=ep, etp=etp, cp_method=cp_method)
    names = [name for name, _, _ in build_model(spec, seq, tp=tp, device="meta").layer_modules]
    num_chunks = config.num_model_chunks
    if len(names) < num_chunks:
        raise ValueError(f"{len(names)} layers cannot fill {num_chunks} pipeline chunks")
    base, extra = divmod(len(names), num_chunks)
    layers, index = [], 0
    for chunk in range(num_chunks):
        for _ in range(base + (chunk < extra)):
            layers.append(LayerAssignment(name=names[index], stage=config.rank_of_chunk(chunk), virtual_stage=chunk // pp, tp=tp,
                                          dp=dp, recompute=recompute))
            index += 1
    return Plan(model=ModelRef(spec=spec, seq=seq, dtype="fp32" if precision == "fp32" else "bf16"),
                cluster=cluster, config=config, layers=tuple(layers), seed=seed)
