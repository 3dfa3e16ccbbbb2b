"""Bridges between meshplan and the training engines people run: torchtitan, Megatron-LM, DeepSpeed.

Both directions go through `EngineJob` (`engines.job`), an engine-neutral description of one
training configuration:

    export_plan(plan, engine) -> Exported            plan.json -> the engine's config text
    read_engine_file(path, engine=None) -> EngineJob  the engine's config -> meshplan's terms
    predict_job(job, model, cluster, ...) -> JobEstimate   EngineJob -> the simulator's Prediction
    size_cluster(...) -> Sizing                        time, GPU-hours and cost; GPU count for a deadline

One module per engine (`torchtitan`, `megatron`, `deepspeed`) holds both translations; what an
engine cannot express is approximated and named in one note per item. This package is a leaf
consumer of the planner: nothing else in the planner imports it.
"""
from __future__ import annotations

ENGINES = ("torchtitan", "megatron", "deepspeed")
