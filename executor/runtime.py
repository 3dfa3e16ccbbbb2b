"""One rank's training machinery for a plan: mesh, stage modules, schedule, optimizer, one step.

`build_runtime` applies the plan (see `executor.parallel` for the order); `train_step` runs one
optimizer step: forward/backward over the plan's micro-batches (through the pipeline schedule
when pp > 1), the tied-embedding all-reduce between first and last stage, global-norm clipping
across every shard, the learning rate of the step, and AdamW.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshplan.executor.parallel.context import apply_cp
from meshplan.executor.parallel.data import apply_dp, mixed_precision
from meshplan.executor.parallel.expert import apply_ep, apply_expert_dp, expert_gradients, expert_meshes
from meshplan.executor.parallel.pipeline import pipeline_schedule
from meshplan.executor.parallel.recompute import apply_recompute
from meshplan.executor.parallel.stages import materialize, split_stages
from meshplan.executor.parallel.tensor import apply_tp
from meshplan.planner.costing.state_memory import dp_method
from meshplan.planner.contracts.engine_rules import early_stop_of
from meshplan.planner.contracts.plan import Plan

TIED_NAMES = ("embed.tok.weight", "head.proj.weight")


@dataclass(frozen=True)
class Hyperparameters:
    """AdamW with linear warm-up then cosine decay to `min_lr_ratio * lr` at the last step."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.1  # warm-up steps = max(1, round(fraction * steps))
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0

    def __post_init__(self):
        if self.lr <= 0 or self.max_grad_norm <= 0:
            raise ValueError(f"lr ({self.lr}) and max_grad_norm ({self.max_grad_norm}) must be positive")
        if not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.warmup_fraction <= 1:
            raise ValueError(f"min_lr_ratio ({self.min_lr_ratio}) and warmup_fraction "
                             f"({self.warmup_fraction}) are fractions in [0, 1]")


def lr_at(step: int, total_steps: int, hp: Hyperparameters) -> float:
    """Learning rate of 0-based step `step` of a `total_steps` run."""
    warmup = max(1, round(hp.warmup_fraction * total_steps))
    if step < warmup:
        return hp.lr * (step + 1) / warmup
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    min_lr = hp.lr * hp.min_lr_ratio
    return min_lr + 0.5 * (hp.lr - min_lr) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Runtime:
    """What one rank holds for a plan. Frozen: the modules and optimizers inside change as it
    trains, the set of them does not."""

    plan: Plan
    device: torch.device
    mesh: Any
    pp_rank: int
    dp_rank: int
    tp_rank: int
    chunk_ids: tuple[int, ...]
    stages: tuple  # StageModule per chunk
    modules: tuple  # what runs: the StageModule, or its DDP wrapper
    optimizers: tuple
    dp_method: str
    norm_weights: tuple  # (param, 1 / how many ranks hold the same gradient values)
    schedule: Any = None  # pipeline schedule when pp > 1
    tied_group: Any = None  # (first stage, last stage) group for a tied embedding split by PP
    tied_local: bool = False  # a tied embedding's two copies both on this rank (V-shaped pipelines)
    loss_fn: Any = None  # file and HF models: loss_fn(output, micro); None: the zoo's next-token loss
    forward_fn: Any = None  # file and HF models: forward_fn(module, micro) -> output
    cp_rank: int = 0  # context-parallel rank: which chunks of every sequence this rank holds
    expert_grads: Any = None  # expert parallelism: `expert.ExpertGradients`, finished after the backward

    @property
    def holds_last_chunk(self) -> bool:
        return self.plan.config.num_model_chunks - 1 in self.chunk_ids

    @property
    def holds_first_chunk(self) -> bool:
        return 0 in self.chunk_ids

    def parameters(self):
        seen = set()
        for stage in self.stages:
            for param in stage.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param


def _shard_stages(stages, mesh, plan: Plan, recompute: dict, has_experts: bool):
    """TP, CP and the experts' own layout on the meta stages, before materialising (each rank then
    writes only its shards): whether the experts are laid out on their own, and their data mesh."""
    cfg = plan.config
    if cfg.tp > 1:
        for stage in stages:
            apply_tp(stage, mesh["tp"], cfg.sp, recompute)
    if cfg.cp > 1:
        for stage in stages:
            apply_cp(stage, mesh["cp"], plan.model.seq, cfg.cp_method)
    if not (has_experts and cfg.ep * cfg.tp * cfg.expert_tp > 1):
        return False, None
    meshes = expert_meshes(mesh, cfg)
    for stage in stages:
        apply_ep(stage, meshes)
    return True, meshes.edp


def build_runtime(plan: Plan, device: torch.device, hp: Hyperparameters, seed: int) -> Runtime:
    """Build this rank's part of `plan` from the meta device up, weights from `seed`; collective."""
    from meshplan.planner.models.registry import build_model

    cfg = plan.config
    mesh, dp_mesh = _device_meshes(device, cfg)
    pp_rank, dp_rank, tp_rank = (mesh.get_local_rank(name) for name in ("pp", "dp", "tp"))
    cp_rank = mesh.get_local_rank("cp") if cfg.cp > 1 else 0
    built = build_model(plan.model.spec, plan.model.seq, tp=cfg.tp, device="meta")
    if built.config is None:
        if built.info.family == "hf" and (cfg.tp > 1 or cfg.pp > 1):  # decoder layers split or staged
            from meshplan.executor.parallel.hf import build_hf_parts

            return _parts_runtime(plan, device, hp, mesh, build_hf_parts(plan, device, seed, mesh, dp_mesh))
        from meshplan.executor.filemodel import file_parts

        return _parts_runtime(plan, device, hp, mesh, file_parts(plan, device, seed, dp_mesh))
    tied = bool(built.config.tied_embeddings)
    chunk_ids = cfg.chunks_of_rank(pp_rank)  # V-shaped schedules: (rank, 2 pp - 1 - rank)
    stages = split_stages(built.module, [layer.name for layer in plan.layers], plan.chunks(), list(chunk_ids))
    recompute = {layer.name: layer.recompute for layer in plan.layers}
    folded, edp_mesh = _shard_stages(stages, mesh, plan, recompute, bool(built.info.num_experts))
    template = build_model(plan.model.spec, plan.model.seq, tp=cfg.tp, device="meta").module
    materialize(stages, template, seed, device, tied)
    for stage in stages:
        # The embedding keeps only token ids for backward, so recomputing it saves nothing; and
        # a vocab-parallel lookup cannot be replayed (its output mask lives in the forward).
        for name in stage.layer_names:
            if name != "embed":
                apply_recompute(stage.layer(name), recompute[name], early_stop_of(cfg))
    method = dp_method(cfg.zero, cfg.data_ranks, cfg.tp, cfg.pp, cfg.precision)
    mp_policy = mixed_precision(cfg.precision)
    # experts first: their own FSDP units (ZeRO 1-3, bf16-mixed ZeRO-0), or left out of DDP / replicate
    left_out = set().union(*(apply_expert_dp(stage, edp_mesh, cfg.zero, method, mp_policy)
                             for stage in stages)) if folded else set()
    modules = tuple(apply_dp(stage, dp_mesh, cfg.zero, method, mp_policy, left_out) for stage in stages)
    _set_aux_grad_scale(stages, cfg)
    schedule = tied_group = None
    if cfg.pp > 1:
        schedule = pipeline_schedule(cfg, mesh, modules, chunk_ids, device, built.loss_fn)
        if tied and cfg.rank_of_chunk(cfg.num_model_chunks - 1) != 0:  # a V keeps both copies on rank 0
            tied_group = _tied_group(mesh, cfg.pp, cfg.dp, cfg.cp * cfg.tp)
    return Runtime(plan=plan, device=device, mesh=mesh, pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank,
                   chunk_ids=chunk_ids, stages=tuple(stages), modules=modules,
                   optimizers=tuple(_adamw(stage, hp) for stage in stages), dp_method=method,
                   norm_weights=_norm_weights(stages, cfg, tied), schedule=schedule, tied_group=tied_group,
                   tied_local=tied and {0, cfg.num_model_chunks - 1} <= set(chunk_ids) and cfg.pp > 1,
                   cp_rank=cp_rank,
                   expert_grads=expert_gradients(stages, edp_mesh, cfg.data_ranks, left_out) if folded else None)


def _parts_runtime(plan: Plan, device: torch.device, hp: Hyperparameters, mesh, parts) -> Runtime:
    """A file or HF model's `filemodel.ModelParts` with the zoo's optimizer, global norm and,
    when pp > 1, pipeline schedule and tied-embedding exchange."""
    cfg = plan.config
    pp_rank, dp_rank, tp_rank = (mesh.get_local_rank(name) for name in ("pp", "dp", "tp"))
    last = cfg.num_model_chunks - 1
    schedule = tied_group = None
    if cfg.pp > 1:
        schedule = pipeline_schedule(cfg, mesh, parts.modules, parts.chunk_ids, device, parts.loss_fn)
        if parts.tied and cfg.rank_of_chunk(last) != 0:  # a V keeps both copies on rank 0
            tied_group = _tied_group(mesh, cfg.pp, cfg.dp, cfg.tp)
    return Runtime(plan=plan, device=device, mesh=mesh, pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank,
                   chunk_ids=parts.chunk_ids, stages=parts.stages, modules=parts.modules,
                   optimizers=tuple(_adamw(stage, hp) for stage in parts.stages), dp_method=parts.dp_method,
                   norm_weights=_norm_weights(parts.stages, cfg, parts.tied), schedule=schedule,
                   tied_group=tied_group, tied_local=parts.tied and cfg.pp > 1 and {0, last} <= set(parts.chunk_ids),
                   loss_fn=parts.loss_fn, forward_fn=parts.forward_fn)


def _set_aux_grad_scale(stages, cfg) -> None:
    """MoE blocks send their load-balancing loss's gradient in themselves: scale it as the loop
    scales each micro-batch's loss (1 / micro-batches; a pipeline schedule divides the gradients
    by the micro-batches after the step instead)."""
    from meshplan.planner.models.moe import MoE

    for stage in stages:
        for module in stage.modules():
            if isinstance(module, MoE):
                module.aux_grad_scale = 1.0 / cfg.num_microbatches if cfg.pp == 1 else 1.0


def _adamw(stage, hp: Hyperparameters):
    from torch.distributed.tensor import DTensor

    params = list(stage.parameters())
    # foreach kernels cannot mix DTensors of different meshes (TP 2-D vs FSDP 1-D parameters).
    foreach = False if any(isinstance(p, DTensor) for p in params) else None
    return torch.optim.AdamW(params, lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                             weight_decay=hp.weight_decay, foreach=foreach)


def _norm_weights(stages, cfg, tied: bool) -> tuple:
    """Per parameter, 1 / (number of ranks holding a copy of the same gradient values).

    Summing local squared-gradient sums times this weight over the whole world counts every
    gradient element exactly once: DTensor shards are distinct, replicated copies (plain
    tensors, Replicate placements, DDP) are shared by dp * tp / (number of shards) ranks, and a
    tied embedding split across pipeline stages appears on the first and the last stage.
    """
    from torch.distributed.tensor import DTensor

    names = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            names.setdefault(id(param), name)
    weights = []
    params = {id(p): p for stage in stages for p in stage.parameters()}
    for param in params.values():
        num_shards = 1
        if isinstance(param, DTensor):
            for dim, placement in enumerate(param.placements):
                # Shard or FSDP-over-TP's _StridedShard (whose is_shard() is False): distinct pieces
                if not (placement.is_replicate() or placement.is_partial()):
                    num_shards *= param.device_mesh.size(dim)
        copies = cfg.stride("pp") / num_shards  # the ranks of one pipeline stage, dp * cp * tp
        if tied and cfg.pp > 1 and names.get(id(param)) in TIED_NAMES:
            copies *= 2
        weights.append((param, 1.0 / copies))
    return tuple(weights)


def _device_meshes(device: torch.device, cfg):
    """(the (pp, dp, [cp,] tp) mesh, the mesh data parallelism reduces and shards over).

    The dimensions are the registry's mesh axes in its order (`contracts.axes.MESH_AXES`), an
    optional one (cp) only when it is on. HSDP splits dp into (dp_replicate, dp_shard), shard
    innermost so that a shard group is consecutive data-parallel ranks (inside a node when
    shard * tp fits one); FSDP2 takes that 2-D mesh and shards over its last dimension,
    replicating over the first. The flattened "dp" dimension keeps every other use (data order,
    tied-weight groups) unchanged. Data parallelism (gradients, ZeRO) spans dp x cp, as in
    torchtitan's dp_shard_cp.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.planner.contracts.axes import MESH_AXES

    dims: list[tuple[str, int]] = []
    for axis in MESH_AXES:
        degree = getattr(cfg, axis.name)
        if axis.name == "dp" and cfg.shard_group:
            dims += [("dp_replicate", cfg.dp // cfg.shard_group), ("dp_shard", cfg.shard_group)]
        elif not axis.optional or degree > 1:
            dims.append((axis.name, degree))
    mesh = init_device_mesh(device.type, tuple(size for _, size in dims),
                            mesh_dim_names=tuple(name for name, _ in dims))
    if not cfg.shard_group:
        return mesh, (mesh["dp"] if cfg.cp == 1 else mesh[("dp", "cp")]._flatten("dp_cp"))
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    if cfg.cp == 1:
        return mesh, mesh[("dp_replicate", "dp_shard")]
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    return mesh, mesh[("dp_replicate", "dp_shard_cp")]


def _tied_group(mesh, pp: int, dp: int, tp: int):
    """The two-rank group (first stage, last stage) at this rank's (dp, tp) coordinate; `tp`
    counts every rank inside a stage's data-parallel slot (cp x tp under context parallelism)."""
    ranks = mesh.mesh.reshape(pp, dp, tp)
    mine = None
    for dp_index in range(dp):  # every rank creates every group, in the same order
        for tp_index in range(tp):
            pair = [int(ranks[0, dp_index, tp_index]), int(ranks[pp - 1, dp_index, tp_index])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
    return mine


def train_step(runtime: Runtime, step: int, total_steps: int, inputs, targets, hp: Hyperparameters):
    """One optimizer step on this replica's (inputs, targets); returns the mean micro-batch loss
    on ranks that hold the last chunk (None elsewhere) and the global gradient norm. A MoE
    model's load-balancing loss is added by the rank(s) holding its blocks, so the sum over the
    pipeline is the objective. A non-finite norm (the same on every rank) skips the update."""
    for optimizer in runtime.optimizers:
        optimizer.zero_grad(set_to_none=True)
    if runtime.schedule is not None:
        loss = _pipeline_forward_backward(runtime, inputs, targets)
    elif runtime.loss_fn is not None:  # file models: a tuple of inputs; HF: tokens and targets
        loss = _file_forward_backward(runtime, inputs if targets is None else (inputs, targets))
    else:
        loss = _forward_backward(runtime, inputs, targets)
    aux = _take_aux_loss(runtime)
    if aux is not None:  # MoE: each rank adds the load-balancing loss of the blocks it holds
        loss = aux if loss is None else loss + aux
    if runtime.expert_grads is not None:
        runtime.expert_grads.finish()
    _align_grad_placements(runtime)
    if runtime.tied_group is not None:
        _all_reduce_tied_grads(runtime)
    elif runtime.tied_local:
        _sum_local_tied_grads(runtime)
    grad_norm = clip_grad_norm(runtime, hp.max_grad_norm)
    if not math.isfinite(grad_norm):
        return loss, grad_norm  # NaN/inf gradients would poison the weights: leave them as they were
    lr = lr_at(step, total_steps, hp)
    for optimizer in runtime.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    return loss, grad_norm


def _take_aux_loss(runtime: Runtime):
    """The load-balancing part of the step's loss from this rank's MoE blocks (None without any)."""
    if runtime.loss_fn is not None:
        return None
    from meshplan.planner.models.moe import take_aux_loss

    cfg = runtime.plan.config
    recompute = {layer.name: layer.recompute for layer in runtime.plan.layers}
    parts = []
    for stage in runtime.stages:
        for index, block in stage.blocks.items():
            last = None
            if runtime.schedule is not None:
                # torch's pipeline stages first run one forward (and backward) on placeholder
                # tensors to infer shapes: keep the step's own forwards, the last m (2m recomputed)
                last = cfg.num_microbatches * (2 if recompute.get(f"blocks.{index}") == "full" else 1)
            part = take_aux_loss(block, last)
            if part is not None:
                parts.append(part)
    return torch.stack(parts).sum().float() if parts else None


def _loss_context(runtime: Runtime):
    """Under TP the logits are sharded over the vocabulary: cross entropy (forward and backward)
    must run inside `loss_parallel`, which reduces the softmax statistics across TP ranks."""
    if runtime.plan.config.tp == 1:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _scalar(loss) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    loss = loss.detach()
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).float()


def _pipeline_forward_backward(runtime: Runtime, inputs, targets):
    losses: list = []
    args = (inputs.to(runtime.device),) if runtime.holds_first_chunk else ()
    with _loss_context(runtime):
        if runtime.holds_last_chunk:
            # the losses are all this step needs: the last chunk's outputs (the logits of every
            # micro-batch) are not kept until the step ends
            runtime.schedule.step(*args, target=targets.to(runtime.device), losses=losses, return_outputs=False)
            return torch.stack([_scalar(loss) for loss in losses]).mean()
        runtime.schedule.step(*args, return_outputs=False)
    return None


def _forward_backward(runtime: Runtime, inputs, targets):
    """Gradient accumulation over the plan's micro-batches (no pipeline)."""
    from meshplan.planner.models.transformer import lm_loss

    module = runtime.modules[0]
    num_microbatches = runtime.plan.config.num_microbatches
    # ZeRO-0/1: reduce gradients once, after the last micro-batch; ZeRO-2/3: after each one.
    defer_sync = runtime.plan.config.zero <= 1
    total = torch.zeros((), device=runtime.device)
    for index, (x, y) in enumerate(zip(inputs.chunk(num_microbatches), targets.chunk(num_microbatches))):
        last = index == num_microbatches - 1
        with _gradient_sync(runtime, module, last or not defer_sync, last), _loss_context(runtime):
            loss = lm_loss(module(x.to(runtime.device)), y.to(runtime.device))
            (loss / num_microbatches).backward()
        total += _scalar(loss)
    return total / num_microbatches


def _file_forward_backward(runtime: Runtime, inputs: tuple):
    """A file or HF model: gradient accumulation over micro-batches of a tuple of inputs (HF:
    tokens and targets), the runtime's forward and loss."""
    module = runtime.modules[0]
    cfg = runtime.plan.config
    num_microbatches = cfg.num_microbatches
    defer_sync = cfg.zero <= 1
    total = torch.zeros((), device=runtime.device)
    pieces = [x.chunk(num_microbatches) for x in inputs]
    for index in range(num_microbatches):
        micro = tuple(piece[index].to(runtime.device) for piece in pieces)
        last = index == num_microbatches - 1
        with _gradient_sync(runtime, module, last or not defer_sync, last):
            loss = runtime.loss_fn(runtime.forward_fn(module, micro), micro)
            (loss.float() / num_microbatches).backward()
        total += _scalar(loss)
    return total / num_microbatches


def _gradient_sync(runtime: Runtime, module, sync: bool, last: bool):
    """Reduce this micro-batch's gradients or not (`sync`). Under FSDP2, ZeRO 0-2 also keep the
    gathered (bf16) parameters from one micro-batch's backward to the next one's forward, as
    the engines do: one gather and one cast per step, not one per micro-batch (the peak holds
    them anyway, from the forward's end to the backward's start); ZeRO-3 reshards after every
    backward."""
    if runtime.dp_method == "ddp":
        return nullcontext() if sync else module.no_sync()
    if runtime.dp_method in ("fsdp", "replicate"):
        module.set_requires_gradient_sync(sync)
        module.set_reshard_after_backward(last or runtime.plan.config.zero == 3)
    return nullcontext()


def _align_grad_placements(runtime: Runtime) -> None:
    """Give every DTensor gradient its parameter's placement before the norm, the tied-embedding
    exchange and the update. Sequence-parallel norm weights (replicated, but each rank saw only
    its sequence shard) get Partial(sum) gradients: all-reduced here; the vocab-parallel
    embedding gets a Replicate gradient of the whole table: each rank keeps its rows."""
    from torch.distributed.tensor import DTensor

    for param in runtime.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)


def _all_reduce_tied_grads(runtime: Runtime) -> None:
    """Megatron-LM: the embedding's gradient is the sum of its first- and last-stage parts."""
    from torch.distributed.tensor import DTensor

    for stage in runtime.stages:
        for name, param in stage.named_parameters():
            if name in TIED_NAMES and param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, group=runtime.tied_group)


def _sum_local_tied_grads(runtime: Runtime) -> None:
    """A V-shaped pipeline runs the first and the last chunk on rank 0: the tied embedding's two
    copies are both here, and each gets the sum of their gradients."""
    from torch.distributed.tensor import DTensor

    grads = [param.grad for stage in runtime.stages for name, param in stage.named_parameters()
             if name in TIED_NAMES and param.grad is not None]
    if len(grads) != 2:
        return
    local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    total = local[0] + local[1]  # same shape and sharding: embedding and head are [vocab, hidden]
    for grad in local:
        grad.copy_(total)


def clip_grad_norm(runtime: Runtime, max_norm: float) -> float:
    """Scale gradients so their global L2 norm (over every TP, PP and DP shard) is <= max_norm.

    Same rule as `torch.nn.utils.clip_grad_norm_`: coefficient max_norm / (norm + 1e-6), capped at
    1. Per-tensor norms use the same fused kernel; their weighted squares are summed in float64
    and all-reduced once over the world.
    """
    from torch.distributed.tensor import DTensor

    grads, weights = [], []
    for param, weight in runtime.norm_weights:
        if param.grad is not None:
            grads.append(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad)
            weights.append(weight)
    sum_squares = torch.zeros((), dtype=torch.float64, device=runtime.device)
    if grads:
        norms = torch.stack(torch._foreach_norm(grads)).double()
        sum_squares += (norms.square() * torch.tensor(weights, dtype=torch.float64, device=norms.device)).sum()
    dist.all_reduce(sum_squares)
    total_norm = float(sum_squares.sqrt())
    coefficient = min(1.0, max_norm / (total_norm + 1e-6))
    if coefficient < 1.0 and grads:
        torch._foreach_mul_(grads, coefficient)
    return total_norm
