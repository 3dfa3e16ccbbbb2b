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

Ulysses (`cp_method` "ulysses", `UlyssesShard`; the cost model's rules: `planner.costing.ulysses`):
the same sequence chunks, but attention exchanges heads for tokens. An autograd-aware all-to-all
(torch's functional `all_to_all_single_autograd`, which gloo runs) gives each rank the whole
sequence of heads/cp of its query heads and of their K/V heads (K/V heads fewer than cp are
replicated first, so that each rank receives the one its queries read; autograd sums the
replicas' gradients); the rank reorders the gathered tokens by position, runs causal SDPA on the
whole sequence, and a fourth all-to-all returns the output to sequence shards of all heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from meshplan.planner.contracts.config import DEFAULT_CP_METHOD
from meshplan.planner.costing.ulysses import ULYSSES, ulysses_kv_heads


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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's (batch, heads, tokens, head_dim) queries against the
        whole sequence's keys: the output for this rank's tokens, all its heads."""
        k, v, kv_positions = self.exchange(k, v)
        mask = self.positions.to(q.device)[:, None] >= kv_positions.to(q.device)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

    def sum_sequence_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums (batch, n) over this rank's tokens -> over the whole sequence, summed
        over the CP group (all-gathered, autograd-aware: every rank gets every rank's gradient)."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        gathered = all_gather_tensor_autograd(stats.contiguous(), gather_dim=0, group=self.cp_mesh)
        return gathered.view(self.cp_mesh.size(), *stats.shape).sum(0)


class UlyssesShard(SequenceShard):
    """Ulysses: attention over all-to-alls that trade sequence shards for head shards."""

    def __init__(self, seq: int, cp_mesh):
        super().__init__(seq, cp_mesh)
        # the gathered tokens (rank order, `kv_positions`) in position order, and back
        self.to_positions = torch.argsort(self.kv_positions)

    def _heads_for_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, tokens, d) sequence shard -> (batch, heads/cp, seq, d) head shard, in position order."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        cp, (batch, heads, tokens, dim) = self.cp_mesh.size(), x.shape
        # all_to_all_single sends the i-th slice of dim 0 to rank i: put the head groups there
        send = x.reshape(batch, cp, heads // cp, tokens, dim).transpose(0, 1).contiguous()
        received = all_to_all_single_autograd(send, None, None, self.cp_mesh)  # dim 0: the source rank
        gathered = received.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * tokens, dim)
        return gathered.index_select(2, self.to_positions.to(x.device))

    def _tokens_for_heads(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `_heads_for_tokens`: (batch, heads/cp, seq, d) -> (batch, heads, tokens, d)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        cp, (batch, local_heads, seq, dim) = self.cp_mesh.size(), y.shape
        ranked = y.index_select(2, self.kv_positions.to(y.device))  # rank order: rank i's tokens i-th
        send = ranked.reshape(batch, local_heads, cp, seq // cp, dim).permute(2, 0, 1, 3, 4).contiguous()
        received = all_to_all_single_autograd(send, None, None, self.cp_mesh)  # dim 0: the head group
        return received.transpose(0, 1).reshape(batch, cp * local_heads, seq // cp, dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp, kv_heads = self.cp_mesh.size(), k.shape[1]
        replicas = ulysses_kv_heads(kv_heads, cp) // kv_heads
        if replicas > 1:  # fewer K/V heads than ranks: one copy of each per rank whose queries read it
            k, v = k.repeat_interleave(replicas, dim=1), v.repeat_interleave(replicas, dim=1)
        q, k, v = (self._heads_for_tokens(t) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self._tokens_for_heads(out)


def apply_cp(stage, cp_mesh, seq: int, method: str = DEFAULT_CP_METHOD) -> None:
    """Give every attention, MoE (its load-balancing statistics) and embedding module of a stage
    this rank's sequence shard, attending by `method` (`contracts.config.CP_METHODS`)."""
    shard = (UlyssesShard if method == ULYSSES else SequenceShard)(seq, cp_mesh)
    for block in stage.blocks.values():
        block.attn.context = shard
        if hasattr(block, "moe"):
            block.moe.context = shard
    if stage.embed is not None:
        stage.embed.context = shard
