"""Context parallelism: each of `cp` ranks holds 1/cp of every sequence (the cost model's rules:
`planner.costing.context_parallel`).

Load balancing: the sequence is cut into 2*cp chunks and CP rank i takes chunks i and 2cp-1-i,
so under the causal mask every rank does the same attention work. Attention gathers the whole
sequence's K and V over the CP group with torch's autograd-aware all-gather (its backward
reduce-scatters the K/V gradients) and runs SDPA of the local queries against them with a
causal mask built from token positions; RoPE and learned positions use each token's global
position. (torch's `context_parallel` ring attention covers the CUDA flash / efficient / cuDNN
SDPA kernels only, not the CPU kernel the gloo tests run, so the all-gather variant Llama 3 was
trained with is written out here.)
"""
from __future__ import annotations

import torch


def cp_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions of CP rank `rank`'s tokens: chunks rank and 2cp-1-rank of 2cp."""
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2*cp = {2 * cp}")
    chunk = seq // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))


def shard_sequence(tokens: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a (batch, seq, ...) tensor, in the order of `cp_positions`."""
    chunks = tokens.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim).contiguous()


class SequenceShard:
    """What a module of a CP rank needs: its token positions and the K/V exchange."""

    def __init__(self, seq: int, cp_mesh):
        self.cp_mesh = cp_mesh
        cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.positions = cp_positions(seq, cp, rank)
        # all_gather concatenates the ranks' local sequences in rank order
        self.kv_positions = torch.cat([cp_positions(seq, cp, r) for r in range(cp)])

    def exchange(self, k: torch.Tensor, v: torch.Tensor):
        """Whole-sequence (batch, kv_heads, seq, head_dim) K and V, and their positions."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        k_all = all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=self.cp_mesh)
        v_all = all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=self.cp_mesh)
        return k_all, v_all, self.kv_positions

    def sum_sequence_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums (batch, n) over this rank's tokens -> over the whole sequence, summed
        over the CP group (all-gathered, autograd-aware: every rank gets every rank's gradient)."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        gathered = all_gather_tensor_autograd(stats.contiguous(), gather_dim=0, group=self.cp_mesh)
        return gathered.view(self.cp_mesh.size(), *stats.shape).sum(0)


def apply_cp(stage, cp_mesh, seq: int) -> None:
    """Give every attention, MoE (its load-balancing statistics) and embedding module of a stage
    this rank's sequence shard."""
    shard = SequenceShard(seq, cp_mesh)
    for block in stage.blocks.values():
        block.attn.context = shard
        if hasattr(block, "moe"):
            block.moe.context = shard
    if stage.embed is not None:
        stage.embed.context = shard
