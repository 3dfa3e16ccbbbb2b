"""Expert parallelism: each MoE block's routed experts split over `ep` data ranks (the cost
model's rules: `ParallelConfig.ep`).

Layout. EP is carved out of the data ranks (dp x cp, flattened with cp innermost), which are
regrouped as (dp * cp / ep, ep): an EP group is `ep` consecutive data ranks (cp ranks first, then
neighbouring dp replicas), and EP rank r holds experts [r * E / ep, (r + 1) * E / ep) of every
MoE block as a DTensor sharded on the expert dimension over the EP group (so checkpoints and the
global gradient norm see distinct shards). The "expert data-parallel" group is the dp * cp / ep
ranks at the same position in their EP groups: they hold the same experts.

Dispatch (`ExpertDispatcher`, which `MoE.routed_out` calls with its routed copies sorted by
expert): each rank routes its own tokens (top-k on real values, deterministic for equal inputs),
exchanges per-expert counts with `all_to_all_single`, sends each copy to the rank holding its
expert with the autograd-aware `all_to_all_single_autograd` (its backward is the reverse
exchange), runs its local experts on what it received grouped by expert, and sends the outputs
back in the same order; the block weights and combines them as without EP.

Gradients. Non-expert parameters are averaged over all dp * cp ranks as usual. An expert's
gradient on a rank already sums the contributions of every token of its EP group, so the step's
gradient is the sum over the expert data-parallel group divided by dp * cp: for ZeRO 1-3 the
experts are FSDP2 units over the expert data-parallel mesh (torchtitan's layout) whose mean is
rescaled, for ZeRO-0 they are left out of DDP / replicate and all-reduced after the backward
(`ExpertGradients`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

def expert_meshes(mesh, cfg):
    """(EP mesh, expert data-parallel mesh), 1-D each, from the (pp, dp, [cp,] tp) mesh's ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh.mesh.reshape(cfg.pp, cfg.data_ranks // cfg.ep, cfg.ep, cfg.tp)
    regrouped = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "tp"))
    return regrouped["ep"], regrouped["edp"]


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


def apply_ep(stage, ep_mesh) -> None:
    """Keep this EP rank's experts (a Shard(0) DTensor of the stacked weights) and give each MoE
    block the dispatcher; on the meta device, before materialisation writes the weights."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    for moe in moe_blocks(stage):
        num_experts = moe.router.num_experts
        if num_experts % ep_mesh.size():
            raise ValueError(f"ep={ep_mesh.size()} does not divide the {num_experts} experts")
        for linear in (moe.experts.gate, moe.experts.up, moe.experts.down):
            linear.weight = nn.Parameter(distribute_tensor(linear.weight.data, ep_mesh, [Shard(0)]))
        moe.dispatcher = ExpertDispatcher(ep_mesh, num_experts)


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
