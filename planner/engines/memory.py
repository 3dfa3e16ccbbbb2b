"""Model-state memory as each engine allocates it (bytes per parameter on one rank; d = dp ranks).

- torchtitan: FSDP2 with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: fp32
  sharded parameters, gradients and Adam moments, plus the bf16 unsharded copy while gathered:
  exactly what meshplan's executor runs, so the simulator's memory (the "executor" recipe of
  `costing.state_memory`) stands.
- Megatron-LM (`--bf16`): bf16 parameters (2), fp32 gradient buffer `main_grad` (4; gradients
  accumulate and reduce in fp32), fp32 master weights and two Adam moments (12), the 12 sharded
  over d with `--use-distributed-optimizer`: 18 or 6 + 12/d. Its FSDP (ZeRO-2/3) also shards the
  gradients, then the parameters. fp32: 4 + 4 + 8. fp8 (`--fp8-format`) keeps the bf16 layout.
- DeepSpeed: ZeRO as the paper counts it (Rajbhandari et al. 2020, `state_memory.paper_state_bytes`):
  2 + 2 + 12 with stage 1 sharding the 12, stage 2 also the gradients, stage 3 the parameters.

Activations and buffers keep the simulator's figures; only params, grads and optimizer change.
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.state_memory import paper_state_bytes

# fp8 (Transformer Engine): the same bf16 parameters, fp32 main_grad and optimizer; the fp8 weight
# copies are transient and counted with the buffers, as for meshplan's own fp8 recipe.
_MEGATRON = {"bf16-mixed": (2.0, 4.0, 12.0), "fp8": (2.0, 4.0, 12.0), "fp32": (4.0, 4.0, 8.0)}


def engine_state_bytes(engine: str, num_params: float, dp: int, zero: int, precision: str) -> dict[str, float] | None:
    """params / grads / optimizer bytes of `num_params` parameters on one rank; None: the
    executor recipe already is the engine's (torchtitan)."""
    if engine == "deepspeed":
        return paper_state_bytes(num_params, dp, zero, precision)
    if engine == "megatron":
        param, grad, optimizer = _MEGATRON[precision]
        return {"params": num_params * param / (dp if zero >= 3 else 1),
                "grads": num_params * grad / (dp if zero >= 2 else 1),
                "optimizer": num_params * optimizer / (dp if zero >= 1 else 1)}
    return None


def params_per_rank(graph, cluster, config, chunk_of_layer) -> list[float]:
    """Parameters each pipeline rank holds (TP-sharded layers divided, vocabulary padded)."""
    # one tensor-parallel group, unsharded fp32 states: param_bytes / 4 counts the parameters
    counting = ParallelConfig(gpus=config.tp, global_batch=1, tp=config.tp, precision="fp32")
    out = [0.0] * config.pp
    for layer, chunk in zip(graph.layers, chunk_of_layer):
        cost = layer_cost(layer, counting, cluster, graph.info, profile_dtype=graph.dtype, attention=graph.attention,
                          state_recipe="zero-paper")
        out[chunk % config.pp] += cost.param_bytes / 4.0  # fp32 parameters, unsharded: 4 bytes each
    return out


def with_engine_memory(prediction, engine: str, graph, cluster, config, chunk_of_layer):
    """`prediction` with each rank's model states as `engine` allocates them."""
    if engine_state_bytes(engine, 1.0, config.dp, config.zero, config.precision) is None:
        return prediction
    # DeepSpeed's pipeline engine runs ZeRO-1 at most (it refuses ZeRO-2/3 with pipelining)
    zero = min(config.zero, 1) if engine == "deepspeed" and config.pp > 1 else config.zero
    memory = []
    for rank, num_params in enumerate(params_per_rank(graph, cluster, config, chunk_of_layer)):
        states = engine_state_bytes(engine, num_params, config.dp, zero, config.precision)
        memory.append(replace(prediction.memory[rank], **states))
    peak = max(m.total for m in memory)
    return replace(prediction, memory=tuple(memory), peak_memory_bytes=peak,
                   fits=peak <= cluster.device.usable_memory_bytes)
