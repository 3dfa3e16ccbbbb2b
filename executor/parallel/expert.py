"""The MoE blocks' folded expert layout (Megatron-Core's MoE parallel folding; the cost model's
rules: `ParallelConfig.ep`, `etp`, `planner.costing.expert_parallel`).

Layout. The tp * cp * dp ranks of a pipeline stage (in rank order: dp, cp, tp innermost) are
regrouped for the routed experts as (edp, ep, etp), etp innermost (`expert_meshes`). EP rank r
holds experts [r * E / ep, (r + 1) * E / ep) of every MoE block, each split over the `etp`
consecutive ranks of its expert-TP group (gate and up on their output columns, down on its input
rows), as a DTensor sharded over the (ep, etp) mesh (so checkpoints and the global gradient norm
see distinct shards). The "expert data-parallel" group is the edp ranks at the same (ep, etp)
position: they hold the same expert shards. Attention, the router and the shared experts keep the
dense layout (split over tp as `executor.parallel.tensor` splits a block; the shared experts as
its MLP). etp divides tp: the tp ranks of a dense TP group hold the same tokens (no sequence
parallelism with MoE blocks under TP), and the tp / etp expert-TP groups inside one take a
contiguous slice of them each (`TokenSlices`: forward slice, backward all-gather, and back).

Dispatch (`ExpertDispatcher`, which `MoE.routed_out` calls with its routed copies sorted by
expert): each rank routes its own tokens (top-k on real values, deterministic for equal inputs),
exchanges per-expert counts with `all_to_all_single`, sends each copy to the rank holding its
expert with the autograd-aware `all_to_all_single_autograd` (its backward is the reverse
exchange), runs its local experts on what it received grouped by expert, and sends the outputs
back in the same order; the block weights and combines them as without EP. Under expert TP the
ranks of an expert-TP group send the same copies; each computes its share of every expert's
SwiGLU and the group sums the down projection's partial outputs (`ExpertTensorParallel`:
forward all-reduce; its input's gradient is summed likewise in backward).

Gradients. Non-expert parameters are averaged over all dp * cp ranks as usual. An expert's
gradient on a rank already sums the contributions of every token its EP group routed to it, so
the step's gradient is the sum over the expert data-parallel group divided by dp * cp: for ZeRO
1-3 the experts are FSDP2 units over the expert data-parallel mesh (torchtitan's layout) whose
mean is rescaled, for ZeRO-0 they are left out of DDP / replicate and all-reduced after the
backward (`ExpertGradients`). Under HSDP only the dense parameters replicate across shard groups:
the experts keep their own expert data-parallel mesh.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

@dataclass(frozen=True)
class ExpertMeshes:
    """The folded layout's meshes on this rank: `experts` shards the expert weights ((ep, etp),
    or the one of them above 1), `edp` holds the same shards, `ep` and `etp` are its groups, and
    `slices` (None when etp = tp) the tp / etp expert-TP groups that split a tp group's tokens."""

    experts: Any
    ep: Any
    etp: Any
    edp: Any
    slices: Any


def expert_meshes(mesh, cfg) -> ExpertMeshes:
    """The folded (pp, edp, ep, etp) regrouping of the (pp, dp, [cp,] tp) mesh's ranks, and the
    (pp, dp * cp, tp / etp, etp) one whose third dimension slices a tp group's tokens."""
    from torch.distributed.device_mesh import DeviceMesh

    etp = cfg.expert_tp
    ranks = mesh.mesh.reshape(cfg.pp, cfg.expert_data_ranks, cfg.ep, etp)
    regrouped = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "etp"))
    slices = None
    if cfg.tp > etp:  # every rank builds the same meshes in the same order (collective)
        sliced = DeviceMesh(mesh.device_type, mesh.mesh.reshape(cfg.pp, cfg.data_ranks, cfg.tp // etp, etp),
                            mesh_dim_names=("pp", "dcp", "slice", "inner"))
        slices = sliced["slice"]
    experts = (regrouped[("ep", "etp")] if cfg.ep > 1 and etp > 1
               else regrouped["etp"] if etp > 1 else regrouped["ep"])
    return ExpertMeshes(experts=experts, ep=regrouped["ep"], etp=regrouped["etp"], edp=regrouped["edp"],
                        slices=slices)


def moe_blocks(stage):
    """The stage's MoE modules (blocks without one, the dense leading blocks, are skipped)."""
    return [block.moe for block in stage.blocks.values() if hasattr(block, "moe")]


class ExpertDispatcher:
    """The token exchange of one EP rank: `dispatcher(experts, dispatched, counts)` returns the
    expert outputs of `dispatched` (routed copies grouped by global expert, `counts[e]` each)."""

    def __init__(self, ep_mesh, num_experts: int):
        self.ep_mesh = ep_mesh
        self.ep = ep_mesh.size()
        self.num_local = num_experts // self.ep

    def __call__(self, experts, dispatched: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if dispatched.is_meta:  # shape propagation only: one output row per routed copy
            return torch.empty_like(dispatched)
        import torch.distributed._functional_collectives as funcol

        send_counts = torch.tensor(counts, dtype=torch.int64, device=dispatched.device)
        recv_counts = torch.empty_like(send_counts)
        # recv_counts.view(ep, local)[s, j]: copies rank s sends to this rank's expert j
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_mesh.get_group())
        per_source = recv_counts.view(self.ep, self.num_local)
        send_splits = send_counts.view(self.ep, self.num_local).sum(1).tolist()
        recv_splits = per_source.sum(1).tolist()
        received = funcol.all_to_all_single_autograd(dispatched.contiguous(), recv_splits, send_splits, self.ep_mesh)
        order = _expert_major_order(per_source)  # (source, expert) order -> (expert, source)
        out = experts(received.index_select(0, order), per_source.sum(0).tolist())
        back = torch.empty_like(out).index_copy(0, order, out)  # the order the copies arrived in
        return funcol.all_to_all_single_autograd(back, send_splits, recv_splits, self.ep_mesh)


def _expert_major_order(per_source: torch.Tensor) -> torch.Tensor:
    """Indices that regroup rows arriving source by source (each source's rows by local expert)
    into expert by expert (each expert's rows by source)."""
    flat = per_source.flatten().tolist()
    starts, position = [], 0
    for count in flat:
        starts.append(position)
        position += count
    num_sources, num_local = per_source.shape
    pieces = [torch.arange(starts[s * num_local + j], starts[s * num_local + j] + flat[s * num_local + j])
              for j in range(num_local) for s in range(num_sources)]
    return torch.cat(pieces).to(per_source.device) if pieces else per_source.new_zeros(0)


def apply_ep(stage, meshes: ExpertMeshes) -> None:
    """Keep this rank's expert shards (a DTensor of the stacked weights: Shard(0) over ep, the
    SwiGLU's width over etp), give each MoE block the dispatcher, the expert-TP sum and the token
    slices its layout needs; on the meta device, before materialisation writes the weights."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    ep, etp = meshes.ep.size(), meshes.etp.size()
    for moe in moe_blocks(stage):
        num_experts = moe.router.num_experts
        if num_experts % ep:
            raise ValueError(f"ep={ep} does not divide the {num_experts} experts")
        if ep * etp > 1:
            # (experts, in, out): gate and up split their output columns, down its input rows
            for linear, width_dim in ((moe.experts.gate, 2), (moe.experts.up, 2), (moe.experts.down, 1)):
                placements = ([Shard(0)] if ep > 1 else []) + ([Shard(width_dim)] if etp > 1 else [])
                linear.weight = nn.Parameter(distribute_tensor(linear.weight.data, meshes.experts, placements))
        if ep > 1:
            moe.dispatcher = ExpertDispatcher(meshes.ep, num_experts)
        if etp > 1:
            moe.experts.tensor_parallel = ExpertTensorParallel(meshes.etp.get_group())
        if meshes.slices is not None:
            moe.token_slices = TokenSlices(meshes.slices)


class TokenSlices:
    """The tp / etp expert-TP groups of a tp group (which holds the same tokens) each route a
    contiguous slice of the tokens; `gather` puts the combined slices back together."""

    def __init__(self, mesh):
        self.group, self.parts, self.index = mesh.get_group(), mesh.size(), mesh.get_local_rank()

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] % self.parts:
            raise ValueError(f"{rows.shape[0]} tokens do not split into {self.parts} equal slices over the "
                             "expert-TP groups of a tp group; use a batch * sequence that divides")
        if not rows.requires_grad:
            return rows.chunk(self.parts)[self.index]
        return _SliceRows.apply(rows, self)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return _GatherRows.apply(rows, self)


def _all_gather_rows(rows: torch.Tensor, slices: TokenSlices) -> torch.Tensor:
    pieces = [torch.empty_like(rows) for _ in range(slices.parts)]
    dist.all_gather(pieces, rows.contiguous(), group=slices.group)
    return torch.cat(pieces)


class _SliceRows(torch.autograd.Function):
    """This slice of rows every rank of the group holds alike; backward gathers the slices'
    gradients (each rank's rows feed only its slice's computation)."""

    @staticmethod
    def forward(ctx, rows, slices):
        ctx.slices = slices
        return rows.chunk(slices.parts)[slices.index].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.slices), None


class _GatherRows(torch.autograd.Function):
    """The group's slices concatenated; backward keeps this slice of the gradient, which every
    rank of the group computes alike downstream."""

    @staticmethod
    def forward(ctx, rows, slices):
        ctx.slices = slices
        return _all_gather_rows(rows, slices)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.slices.parts)[ctx.slices.index].contiguous(), None


class ExpertTensorParallel:
    """Megatron's column-then-row split of each expert's SwiGLU over an expert-TP group:
    `enter` (identity; backward sums the input's partial gradients), `exit` (sums the down
    projection's partial outputs; backward identity)."""

    def __init__(self, group):
        self.group = group

    def enter(self, rows: torch.Tensor) -> torch.Tensor:
        return _SumGradients.apply(rows, self.group)

    def exit(self, rows: torch.Tensor) -> torch.Tensor:
        return _SumOutputs.apply(rows, self.group)


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, group):
        ctx.group = group
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, group):
        out = rows.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def expert_parameters(stage) -> list:
    return [param for moe in moe_blocks(stage) for param in moe.experts.parameters()]


def apply_expert_dp(stage, edp_mesh, zero: int, method: str, mp_policy=None) -> set:
    """Data parallelism of the experts over their expert data-parallel mesh, before `apply_dp`.

    ZeRO 1-3: one FSDP2 unit per block's experts over `edp_mesh` (which averages their gradients
    over it); returns no parameters. bf16-mixed ZeRO-0: one `replicate` unit per block's experts
    over `edp_mesh`, so that the mixed-precision policy casts them too. fp32 ZeRO-0: returns the
    expert parameters, which DDP / replicate must leave out. `ExpertGradients.finish` completes
    them all after the backward.
    """
    if method in ("ddp", "none") or (method == "replicate" and mp_policy is None):
        return set(expert_parameters(stage))
    kwargs = {"mesh": edp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if method == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate as wrap
    else:
        from torch.distributed.fsdp import fully_shard as wrap

        kwargs["reshard_after_forward"] = zero == 3
    for moe in moe_blocks(stage):
        wrap(moe.experts, **kwargs)
    return set()


@dataclass(frozen=True)
class ExpertGradients:
    """What the step does to expert gradients after the backward: make each the sum over the
    expert data-parallel group divided by dp * cp. (FSDP2's `set_gradient_divide_factor` would
    fold the division into the reduce-scatter, but gloo has no PREMUL_SUM.)"""

    params: tuple
    edp_mesh: Any
    data_ranks: int
    by_hand: bool  # ZeRO-0: not reduced yet; ZeRO 1-3: FSDP averaged them over the edp mesh

    def finish(self) -> None:
        from torch.distributed.tensor import DTensor

        num_replicas = self.edp_mesh.size()
        for param in self.params:
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if self.by_hand:
                if num_replicas > 1:
                    dist.all_reduce(grad, group=self.edp_mesh.get_group())
                grad.div_(self.data_ranks)
            else:  # mean over the edp replicas -> their sum / (dp * cp)
                grad.mul_(num_replicas / self.data_ranks)


def expert_gradients(stages, edp_mesh, data_ranks: int, left_out: set) -> ExpertGradients:
    params = tuple(param for stage in stages for param in expert_parameters(stage))
    return ExpertGradients(params=params, edp_mesh=edp_mesh, data_ranks=data_ranks, by_hand=bool(left_out))
