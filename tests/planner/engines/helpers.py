"""Plans for the engine tests, built without the solver (uniform cuts, then edited)."""
from __future__ import annotations

from dataclasses import replace

from meshplan.executor.plans import uniform_plan
from meshplan.planner.costing.hardware import load_cluster

SPEC = "llama:layers=6,hidden=256,heads=8,kv_heads=4,ffn=512,vocab=1024"
SEQ = 128
MOE_SPEC = "moe:layers=4,hidden=128,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=256,vocab=1024"


def make_plan(*, tp=2, pp=2, dp=2, mbs=2, zero=1, sp=True, schedule="1f1b", vpp=1, recompute="none",
              counts=None, modes=None, gbs=32, cp=1, ep=1, shard_group=None, spec=SPEC):
    """A bf16 plan on a100-80g; `counts` re-cuts the chunks (layers per chunk), `modes` sets each
    block's recomputation (embedding and head stay none)."""
    plan = uniform_plan(spec, SEQ, gbs, load_cluster("a100-80g"), tp=tp, pp=pp, dp=dp, microbatch_size=mbs,
                        zero=zero, schedule=schedule, virtual_stages=vpp, recompute="none", sp=sp,
                        precision="bf16-mixed", cp=cp, ep=ep, shard_group=shard_group)
    layers = list(plan.layers)
    if counts is not None:
        chunk_of = [chunk for chunk, count in enumerate(counts) for _ in range(count)]
        layers = [replace(layer, stage=chunk % pp, virtual_stage=chunk // pp) for layer, chunk in zip(layers, chunk_of)]
    block_modes = iter(modes or [recompute] * (len(layers) - 2))
    layers = [layer if layer.name in ("embed", "head") else replace(layer, recompute=next(block_modes))
              for layer in layers]
    return replace(plan, layers=tuple(layers))


def as_engine_runs_it(plan, engine: str):
    """The plan with `engine` running it: its overlap and memory recipe (`contracts.overlap`,
    `costing.engine_memory`), the configuration and assignment unchanged."""
    return replace(plan, config=replace(plan.config, engine=engine))
