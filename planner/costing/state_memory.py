"""Model-state bytes per rank (parameters, gradients, optimizer states) under each ZeRO stage.

Two recipes, named by `layer_cost`'s `state_recipe`:

"zero-paper" (Rajbhandari et al. 2020, the bf16-mixed recipe): bf16 parameters and
gradients, fp32 master weights and two fp32 Adam moments, 2 + 2 + 12 bytes per parameter;
stage 1 shards the 12, stage 2 also the gradients, stage 3 also the parameters over dp ranks:
16P, 4P + 12P/d, 2P + 14P/d, 16P/d. fp32: 4 + 4 + 8.

"executor" (what `meshplan train` allocates; its data-parallel wrapper per `dp_method`). Under
bf16-mixed every layout runs FSDP2's mixed-precision policy (`replicate` for ZeRO-0 or a single
data-parallel rank, `fully_shard` for ZeRO 1-3): bf16 compute weights materialised once and kept
for the step, fp32 masters and gradients, so the residual stream and every saved activation are
bf16 as in the engines. The same 18 bytes per parameter as Megatron-LM's mixed precision (bf16
parameter, fp32 main gradient, fp32 master and two moments), split differently.
- no DP (fp32): fp32 parameters and gradients: 4 + 4 + 8;
- DDP (fp32, ZeRO-0 on plain data parallelism): as no DP, plus DDP's gradient buckets: the Reducer
  keeps one flat fp32 bucket tensor per bucket covering every parameter and copies each
  gradient into it to all-reduce (`gradient_as_bucket_view=False`, the default the executor
  uses), so every gradient is held twice: 4 + (4 + 4) + 8 (measured on CPU: the rebuilt
  buckets of the second iteration sum to exactly the gradient bytes);
- FSDP2 `replicate` (ZeRO-0 with TP or PP, or any bf16-mixed ZeRO-0 layout): fp32 parameters and
  gradients plus the bf16 compute copy of every parameter the mixed-precision policy keeps
  unsharded: 6 + 4 + 8 (fp32: 4 + 4 + 8);
- FSDP2 `fully_shard`: fp32 sharded parameters (4/d), fp32 sharded gradients (4/d; the
  reduce dtype) and Adam moments (8/d). ZeRO-1/2 (`reshard_after_forward=False`) also hold the
  bf16 unsharded parameters during the step (+2); ZeRO-1 defers gradient sync to the last
  micro-batch, so the unsharded fp32 gradient accumulates in full (4 instead of 4/d):
  6P + 12P/d, 2P + 16P/d, 16P/d. Under fp32 the unsharded copy is fp32 (+4).
Gradients are reduced in fp32 by the executor (DDP on fp32 gradients; FSDP2 reduce dtype fp32),
4 bytes per parameter on the wire, as Megatron-LM does by default.

HSDP (`shard_group` N < dp): every "/d" above becomes "/N": states are sharded over the N ranks
of a shard group and replicated across the dp/N groups (FSDP2 on a 2-D mesh).

ZeRO-2/3 reduce-scatter after every micro-batch's backward, pipelined or not (the simulator plays
that); under a split-backward (zero-bubble) schedule they execute as ZeRO-1 (`executed_zero`).
ZeRO-1/2 parameters stay gathered from the step's first forward to its last backward, pipelined
or not (`communication.dp_comm_s`).
"""
from __future__ import annotations

from meshplan.planner.contracts.engine_rules import grad_buffer_bytes
from meshplan.planner.contracts.schedule import schedule_spec
from meshplan.planner.costing.overlap import grad_reduce_overlaps, pipelined_grad_reduce_blocks

STATE_RECIPES = ("executor", "zero-paper")

# bytes per parameter of the ZeRO paper's recipes: (param, grad, optimizer)
# fp8 keeps bf16-mixed's states (planner.costing.fp8 adds its weight copies and float8 all-gather)
_PAPER = {"bf16-mixed": (2.0, 2.0, 12.0), "fp32": (4.0, 4.0, 8.0), "fp8": (2.0, 2.0, 12.0)}
# DDP's flat bucket copy of each fp32 gradient, bytes per parameter (executor recipe)
DDP_BUCKET_COPY_BYTES = 4.0


def dp_method(zero: int, dp: int, tp: int, pp: int, precision: str = "fp32") -> str:
    """The executor's data-parallel wrapper: "none", "ddp", "replicate" or "fsdp".

    bf16-mixed always runs under FSDP2's mixed-precision policy, which casts each weight to bf16
    once per gather and keeps the residual stream in bf16 (autocast would cast every weight again
    for every micro-batch and keep each cast for its backward): `replicate` for ZeRO-0 and for a
    single data-parallel rank, `fully_shard` for ZeRO 1-3. fp32: DDP only on plain data
    parallelism (it fails under DTensor TP and most pipeline schedules), so ZeRO-0 with TP or PP
    is FSDP2's `replicate`; ZeRO 1-3 are `fully_shard`; one rank runs unwrapped.
    """
    if precision != "fp32":  # bf16-mixed, and fp8, which keeps its states
        return "fsdp" if dp > 1 and zero >= 1 else "replicate"
    if dp == 1:
        return "none"
    if zero == 0:
        return "ddp" if tp == 1 and pp == 1 else "replicate"
    return "fsdp"


def executed_zero(zero: int, dp: int, pp: int, schedule: str | None = None) -> int:
    """The ZeRO stage the executor really runs. Under torch pipelining (pp > 1) meshplan's
    stages reduce-scatter ZeRO-2/3 gradients after every micro-batch's full backward
    (`executor.parallel.pipeline.ShardedGradStage`; torch's own stage would defer sync and
    resharding to the last one). Schedules that split the backward (`Schedule.split_backward`)
    run the input-gradient half first, before any weight gradient exists, so their reduction
    stays deferred to the step's end: ZeRO-2 would keep full gradients and ZeRO-3 the gathered
    parameters, both run as ZeRO-1, which the planner therefore offers alone."""
    if pp > 1 and dp > 1 and zero >= 2 and schedule is not None and schedule_spec(schedule).split_backward:
        return 1
    return zero


# When gradient reduction runs, as `grad_sync_mode` names it (the simulator's
# `StepCosts.grad_sync` and the ILP's problem validate against it).
GRAD_SYNC_MODES = ("overlap", "overlap_every_microbatch", "after_chunk")


def grad_sync_mode(config) -> str:
    """When meshplan's executor reduces gradients (`simulation.step_costs.StepCosts.grad_sync`; the
    ILP models the same). DDP/FSDP overlap the reduction with the backward, of the last
    micro-batch for ZeRO-0/1 and of every micro-batch for ZeRO-2/3 (which keep gradients sharded
    while accumulating), pipelined or not. Under pipelining ZeRO-0/1 (and ZeRO-2/3 under a
    split-backward schedule) leave it to torch, which reduces a chunk's gradients after its
    last backward (`perform_reduce_grad`), blocking the rank. Under another engine whose
    reduction does not overlap the backward at this ZeRO stage (DeepSpeed below ZeRO-3,
    `EngineOverlap.grad_overlap_min_zero`) it blocks the rank after the backward too. An engine
    that reduces a pipelined rank's gradients in buckets during each chunk's last backward
    (Megatron, `EngineOverlap.pp_grad_reduce`) overlaps them as without pipelining."""
    data_ranks = config.data_ranks
    zero = executed_zero(config.zero, data_ranks, config.pp, config.schedule)
    if config.pp > 1 and data_ranks > 1 and zero <= 1 and pipelined_grad_reduce_blocks(config):
        return "after_chunk"
    if data_ranks > 1 and not grad_reduce_overlaps(config, zero):  # the engine's (`EngineOverlap`)
        return "after_chunk"
    return "overlap_every_microbatch" if zero >= 2 and config.num_microbatches > 1 else "overlap"


# Engines whose data parallelism is FSDP2's under its mixed-precision policy (bf16 parameters,
# fp32 gradient reduction), and whether they defer gradient sync to a step's last micro-batch
# below ZeRO-2: meshplan's executor (`executor.runtime._gradient_sync`) does; torchtitan's trainer
# reduces every micro-batch's gradients (`torchtitan/trainer.py`: no `set_requires_gradient_sync`).
FSDP2_MIXED_PRECISION_ENGINES = {"meshplan": True, "torchtitan": False}
# Engines on torch's FSDP1 with bf16 parameters and fp32 gradient reduction (Composer's DEFAULT mixed
# precision, which llm-foundry's MPT yamls run): every micro-batch's post-backward hook casts the
# unsharded bf16 gradient to fp32 (`flat_param.grad.to(handle._reduce_dtype)`: read 2, write 4) and
# `_reduce_grad` divides it in place by the pre-divide factor before the reduction
# (`_div_if_needed` with `_get_gradient_predivide_factor`, above 1 for any world of 2 or more: read 4,
# write 4); the post-divide runs on the shard.
FSDP1_CAST_BYTES_PER_PARAM, FSDP1_PREDIVIDE_BYTES_PER_PARAM = 6.0, 8.0
FSDP1_MIXED_PRECISION_ENGINES = ("llm-foundry",)


def grad_copy_bytes_per_param(config, zero: int | None = None) -> float:
    """Bytes per parameter (unsharded, on this rank) FSDP2's mixed-precision gradient path reads
    and writes outside the GEMMs, per micro-batch (`FSDPParam.to_accumulated_grad_if_needed`,
    `accumulate_unsharded_grad_if_needed`, `foreach_reduce`'s `_chunk_cat`): where gradient sync
    waits for the last micro-batch, each micro-batch's bf16 gradient is added into an fp32
    accumulation (read 2 + 4, write 4: 10; the first micro-batch's cast and the last one's copy
    into the reduction's input come to about as much); where every micro-batch reduces, its bf16
    gradient is cast into the fp32 reduce-scatter input (read 2, write 4: 6). FSDP1's path
    (llm-foundry, in bf16 and under fp8, whose Transformer Engine Linears keep bf16 parameters)
    casts and pre-divides every micro-batch's gradient: 14 (6 alone without a data group); it runs
    on FSDP1's post-backward stream, charged like FSDP2's on the backward's. The engines without
    FSDP2 accumulate in fp32 inside the weight-gradient GEMM (Megatron-LM's
    gradient_accumulation_fusion into `main_grad`): 0. fp32 training and fp8 (whose states
    meshplan's executor keeps in fp32, with no mixed-precision policy) accumulate in the
    parameter's own dtype through autograd: not charged here either. `zero`: another stage for
    the same config (a ZeRO-2/3 candidate's ZeRO-1 sibling, `search.problems`)."""
    if config.engine in FSDP1_MIXED_PRECISION_ENGINES and config.precision != "fp32":  # fp8 Linears: bf16 params
        return FSDP1_CAST_BYTES_PER_PARAM + (FSDP1_PREDIVIDE_BYTES_PER_PARAM if config.data_ranks > 1 else 0.0)
    defers = FSDP2_MIXED_PRECISION_ENGINES.get(config.engine)
    if defers is None or config.precision != "bf16-mixed":
        return 0.0
    zero = executed_zero(config.zero if zero is None else zero, config.data_ranks, config.pp, config.schedule)
    return 10.0 if defers and zero <= 1 else 6.0


def paper_state_bytes(num_params: float, dp: int, zero: int, precision: str,
                      shard: int | None = None) -> dict[str, float]:
    """`shard`: the ranks ZeRO shards over (HSDP's shard group; all dp ranks by default)."""
    param, grad, optimizer = _paper(precision)
    d = shard or dp
    return {"params": num_params * param / (d if zero >= 3 else 1),
            "grads": num_params * grad / (d if zero >= 2 else 1),
            "optimizer": num_params * optimizer / (d if zero >= 1 else 1)}


def executor_state_bytes(num_params: float, dp: int, zero: int, precision: str, tp: int = 1,
                         pp: int = 1, shard: int | None = None, schedule: str | None = None) -> dict[str, float]:
    """`shard`: HSDP's shard group (FSDP2 on a 2-D (replicate, shard) mesh keeps 1/shard of each
    parameter, gradient and moment); all dp ranks by default."""
    _paper(precision)
    zero = executed_zero(zero, dp, pp, schedule)
    method = dp_method(zero, dp, tp, pp, precision)
    compute_copy = 4.0 if precision == "fp32" else 2.0  # unsharded parameters FSDP2 gathers
    if method == "none":
        return {"params": 4.0 * num_params, "grads": 4.0 * num_params, "optimizer": 8.0 * num_params}
    if method == "ddp":  # .grad plus its copy in DDP's flat bucket (see the module docstring)
        return {"params": 4.0 * num_params, "grads": (4.0 + DDP_BUCKET_COPY_BYTES) * num_params,
                "optimizer": 8.0 * num_params}
    if method == "replicate":
        extra = 0.0 if precision == "fp32" else compute_copy  # fp32 needs no cast copy
        return {"params": (4.0 + extra) * num_params, "grads": 4.0 * num_params, "optimizer": 8.0 * num_params}
    unsharded = compute_copy if zero <= 2 else 0.0
    d = shard or dp
    return {"params": num_params * (4.0 / d + unsharded),
            "grads": num_params * (4.0 if zero == 1 else 4.0 / d),
            "optimizer": num_params * 8.0 / d}


def state_bytes(num_params: float, dp: int, zero: int, precision: str, recipe: str = "zero-paper",
                tp: int = 1, pp: int = 1, shard: int | None = None, schedule: str | None = None) -> dict[str, float]:
    """Resident params / grads / optimizer bytes per rank for `num_params` (already / tp);
    `shard` is HSDP's shard group (None: ZeRO shards over all `dp` ranks); `schedule` the
    pipeline schedule (a split-backward one runs ZeRO-2/3 as ZeRO-1 under pp > 1)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if shard is not None and (shard < 1 or dp % shard):
        raise ValueError(f"shard group {shard} must divide dp={dp}")
    if recipe == "zero-paper":
        return paper_state_bytes(num_params, dp, zero, precision, shard)
    if recipe == "executor":
        return executor_state_bytes(num_params, dp, zero, precision, tp, pp, shard, schedule)
    raise ValueError(f"state recipe must be one of {', '.join(STATE_RECIPES)}, got {recipe!r}")


def grad_wire_bytes_per_param(precision: str, recipe: str, bf16_grads: bool = False) -> float:
    """Bytes per parameter the gradient reduction moves: bf16 in the paper, fp32 in the executor,
    bf16 under Megatron-LM's `--grad-reduce-in-bf16` (`ParallelConfig.grad_reduce_in_bf16`: its
    DDP buffer, and so the reduce-scatter or all-reduce over it, is in the parameters' bf16)."""
    if recipe == "zero-paper":
        return _paper(precision)[1]
    return grad_buffer_bytes(precision, bf16_grads)  # fp32 unless Megatron-LM's buffer is bf16


def _paper(precision: str) -> tuple[float, float, float]:
    if precision not in _PAPER:
        raise ValueError(f"precision must be one of {', '.join(_PAPER)}, got {precision!r}")
    return _PAPER[precision]
