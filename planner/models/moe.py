"""Mixture-of-experts decoder (Mixtral, Qwen2-MoE, Qwen3-MoE shapes) in plain PyTorch, meta-device friendly.

A MoE block is the zoo's Llama block (`planner.models.transformer`: fused RMSNorm, GQA inside
SDPA, RoPE, optional q/k norms and q/k/v biases) with its MLP replaced by `MoE`:

  moe.router  Linear(hidden -> experts) + fp32 softmax + top-k, weights renormalised over the k
  dispatch    the routed copies of the tokens gathered into expert order (an explicit index_select)
  moe.experts the routed experts' SwiGLUs: `gate`, `up`, `down`, weights stacked over experts,
              one matrix product per expert on its contiguous group of tokens
  combine     expert outputs times their routing weights, summed back per token (index_add)
  moe.shared  shared experts: one SwiGLU of width num_shared * shared_ffn every token goes through
              (with Qwen2-MoE's sigmoid gate `moe.shared_gate`)

The first `dense_layers` blocks keep the dense SwiGLU of width `ffn` (`transformer.Block`).

Routing assumption. Which expert a token goes to depends on values, and the meta device has
none, so on meta the router assigns routed copy i (token i // k, choice i % k) to expert
i mod E: every expert receives tokens * k / E copies (the nearest integers when E does not
divide tokens * k), each token k distinct experts. The router still runs its Linear and softmax
and the weights are gathered from its probabilities, so FLOPs and saved bytes are those of a
balanced real step. On a real device the top-k of the probabilities decides, and the same
dispatch, expert and combine code runs on the observed group sizes.

Per token (h hidden, E experts, k top_k, f expert width, F shared width), forward matmul FLOPs
beyond the attention: router 2hE, routed experts k * 3 * 2hf, shared experts 3 * 2hF (+ 2h for
the shared gate).

Load-balancing loss (Switch Transformer's, per sequence as DeepSeek-V3's sequence-wise loss and
Megatron-LM's `seq_aux_loss`): for each sequence, f_e = the share of its routed copies that go to
expert e (counts / (tokens * k), summing to 1) and P_e = its tokens' mean router probability of e
(the softmax before top-k); the block's loss is E * sum_e f_e P_e (1 when balanced), averaged over
the sequences. Training minimises cross entropy + aux_loss_coef * (mean of that over the MoE
blocks). Per sequence, because a sequence is never split across data-parallel or expert-parallel
ranks or micro-batches, so every layout computes the same loss as one process (a context-parallel
rank's share of a sequence is summed over its CP group first). The loss joins the objective in the
backward (`_AuxLossGrad`, Megatron-LM's MoEAuxLossAutoScaler): each block sends its gradient in
itself, so it reaches the router on every pipeline stage without travelling with the logits;
`take_aux_loss` reads the values back for reporting. It runs in training on real devices only:
meta routing is balanced by construction, so the profiler's figures leave it out (a few
elementwise ops per token, no matmul).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from meshplan.planner.models.config import TransformerConfig
from meshplan.planner.models.transformer import (MLP, Attention, Block, CausalLM, Embedding, Head, RMSNorm, normed_call,
                                                 _FusedSwiGLU)


def balanced_counts(num_routed: int, num_experts: int) -> list[int]:
    """Routed copies per expert when copy i goes to expert i mod E: floor or ceil of num_routed / E."""
    return [num_routed // num_experts + (expert < num_routed % num_experts) for expert in range(num_experts)]


class TopKRouter(nn.Module):
    """Scores each token against every expert; returns (weights, experts), each (tokens, top_k)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select(self.probabilities(x), x.dtype)

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, experts) softmax of the scores, in fp32 as engines route."""
        return self.gate(x).float().softmax(dim=-1)

    def select(self, probs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the probabilities (balanced on meta), weights renormalised and cast to `dtype`."""
        if probs.is_meta:
            # Balanced routing (module docstring): copy i of the flattened (tokens, k) goes to i mod E.
            slots = torch.arange(probs.shape[0] * self.top_k, device=probs.device).view(-1, self.top_k)
            experts = slots % self.num_experts
            weights = probs.gather(1, experts)
        else:
            weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(dtype), experts


class GroupedLinear(nn.Module):
    """One Linear per expert, weights stacked as (experts, in, out); rows arrive grouped by expert."""

    def __init__(self, num_experts: int, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, in_dim, out_dim))
        if not self.weight.is_meta:
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # x: (sum(counts), in), rows of expert e contiguous; one (count_e, in) @ (in, out) each.
        # Under expert parallelism the weight is a DTensor sharded over the EP group on the expert
        # dimension and `counts` covers this rank's experts: its local rows are the weights.
        weight = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight
        groups = x.split(counts)
        return torch.cat([group @ weight[expert] for expert, group in enumerate(groups)])


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLUs: down(silu(gate(x)) * up(x)) per expert group."""

    def __init__(self, num_experts: int, hidden: int, expert_ffn: int):
        super().__init__()
        self.gate = GroupedLinear(num_experts, hidden, expert_ffn)
        self.up = GroupedLinear(num_experts, hidden, expert_ffn)
        self.down = GroupedLinear(num_experts, expert_ffn, hidden)

    # Expert tensor parallelism (`executor.parallel.expert.ExpertTensorParallel`, set by the
    # executor): the weights hold this rank's share of each SwiGLU's width; None: whole experts.
    tensor_parallel = None

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        split = self.tensor_parallel
        x = x if split is None else split.enter(x)
        out = self.down(_FusedSwiGLU.apply(self.gate(x, counts), self.up(x, counts)), counts)
        return out if split is None else split.exit(out)


def _swiglu(cfg: TransformerConfig, width: int) -> MLP:
    """The zoo's fused SwiGLU (gate, up -> down) of `width`."""
    return MLP(replace(cfg, ffn=width))


class MoE(nn.Module):
    """Router -> dispatch -> routed experts -> combine, plus shared experts; (batch, seq, h) in and out."""

    # Expert parallelism (`executor.parallel.expert.ExpertDispatcher`, set by the executor): runs
    # the dispatched copies through experts spread over the EP group; None: every expert is here.
    dispatcher = None
    # Context parallelism (`executor.parallel.context.SequenceShard`, set by the executor): this
    # rank holds part of each sequence, so the load-balancing statistics are summed over CP ranks.
    context = None
    # Folded expert layout under TP (`executor.parallel.expert.TokenSlices`, set by the executor):
    # the tp ranks hold the same tokens and each expert-TP group routes a slice of them.
    token_slices = None

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = TopKRouter(cfg.hidden, cfg.num_experts, cfg.top_k)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden, cfg.expert_ffn)
        self.shared = _swiglu(cfg, cfg.shared_ffn_dim) if cfg.num_shared_experts else None
        self.shared_gate = nn.Linear(cfg.hidden, 1, bias=False) if cfg.shared_expert_gate else None
        # this block's weight in the objective: the coefficient over the number of MoE blocks
        self.aux_loss_weight = cfg.aux_loss_coef / (cfg.num_layers - cfg.dense_layers)
        # the factor the training loop applies to each forward's loss before backward (1 / micro-batches
        # under gradient accumulation); the aux loss's gradient gets the same
        self.aux_grad_scale = 1.0
        self._aux_values: list[torch.Tensor] = []  # detached aux loss of each forward since `take_aux_loss`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        out = self.shared_out(tokens) if self.shared is not None else None
        routed = self.routed_out(tokens, num_sequences=x.shape[0] if x.dim() == 3 else 1)
        out = routed if out is None else out + routed
        return out.view(x.shape)

    def shared_out(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.shared(tokens)
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(tokens)) * out
        return out

    def routed_out(self, tokens: torch.Tensor, num_sequences: int = 1) -> torch.Tensor:
        probs = self.router.probabilities(tokens)
        weights, all_experts = self.router.select(probs, tokens.dtype)
        experts, slices = all_experts, self.token_slices
        if slices is not None:  # this expert-TP group's slice; every rank still routed all (the aux loss)
            tokens, weights, experts = slices.scatter(tokens), slices.scatter(weights), slices.scatter(experts)
        flat_experts = experts.flatten()  # (tokens * k,): copy i is token i // k, choice i % k
        order = flat_experts.argsort(stable=True)  # routed copies grouped by expert
        token_of_copy = order // self.top_k
        counts = self.expert_counts(flat_experts, tokens.is_meta)
        dispatched = tokens.index_select(0, token_of_copy)  # dispatch: (tokens * k, h) in expert order
        if self.dispatcher is None:
            expert_out = self.experts(dispatched, counts)
        else:  # the same rows back, computed by the EP rank holding each expert
            expert_out = self.dispatcher(self.experts, dispatched, counts)
        weighted = expert_out * weights.flatten().index_select(0, order).unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, token_of_copy, weighted)  # combine
        if slices is not None:
            out = slices.gather(out)
        if self.aux_loss_weight and self.training and torch.is_grad_enabled() and not tokens.is_meta:
            aux = self.balance_loss(probs, all_experts, num_sequences)
            self._record_aux(aux.detach())
            out = _AuxLossGrad.apply(out, aux, self.aux_loss_weight * self.aux_grad_scale)
        return out

    def balance_loss(self, probs: torch.Tensor, experts: torch.Tensor, num_sequences: int) -> torch.Tensor:
        """Mean over sequences of E * sum_e f_e P_e (module docstring); probs (tokens, E), experts (tokens, k)."""
        num_experts = self.router.num_experts
        per_sequence = probs.shape[0] // num_sequences
        copies = torch.zeros(num_sequences, num_experts, device=probs.device, dtype=probs.dtype)
        copies.scatter_add_(1, experts.reshape(num_sequences, -1), torch.ones_like(experts, dtype=probs.dtype)
                            .reshape(num_sequences, -1))
        stats = torch.cat((copies, probs.view(num_sequences, per_sequence, num_experts).sum(1)), dim=1)
        if self.context is not None:  # the whole sequence's sums: this rank holds 1/cp of it
            stats = self.context.sum_sequence_stats(stats)
            per_sequence *= self.context.cp_mesh.size()
        fraction = stats[:, :num_experts] / (per_sequence * self.top_k)
        mean_prob = stats[:, num_experts:] / per_sequence
        return num_experts * (fraction * mean_prob).sum(dim=1).mean()

    def _record_aux(self, aux: torch.Tensor) -> None:
        # A recomputed forward (activation checkpointing) records the same value again: the mean
        # that `take_aux_loss` reports does not change.
        self._aux_values.append(aux)

    def expert_counts(self, flat_experts: torch.Tensor, meta: bool) -> list[int]:
        num_experts = self.router.num_experts
        if meta:
            return balanced_counts(flat_experts.numel(), num_experts)
        return torch.bincount(flat_experts, minlength=num_experts).tolist()


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the MoE output whose backward also sends `scale` into the aux loss: the loss is
    part of the objective without being added to the logits' loss (Megatron-LM's
    MoEAuxLossAutoScaler), so pipeline stages and recomputation need nothing special."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux, ctx.scale), None


def take_aux_loss(module: nn.Module, last: int | None = None) -> torch.Tensor | None:
    """The load-balancing part of the objective that `module`'s MoE blocks computed since the last
    call: sum over the blocks of their weight times their mean aux loss over the forwards they
    ran (a micro-batch each; `last`: only the last `last` forwards of each block), detached;
    None when none ran. Resets the record."""
    total = None
    for moe in module.modules():
        if isinstance(moe, MoE) and moe._aux_values:
            values = moe._aux_values[-last:] if last else moe._aux_values
            part = moe.aux_loss_weight * torch.stack(values).mean()
            total = part if total is None else total + part
            moe._aux_values = []
    return total


class MoEBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + normed_call(self.attn_norm, x, self.attn)
        return x + normed_call(self.moe_norm, x, self.moe)


class MoECausalLM(CausalLM):
    """embed -> `dense_layers` dense blocks -> MoE blocks -> head; `CausalLM`'s forward."""

    def __init__(self, cfg: TransformerConfig, tp: int = 1):
        if cfg.family != "moe":
            raise ValueError(f"MoECausalLM needs a moe config, got family {cfg.family!r}")
        nn.Module.__init__(self)
        self.cfg = cfg
        self.padded_vocab = cfg.padded_vocab(tp)
        self.embed = Embedding(cfg, self.padded_vocab)
        self.blocks = nn.ModuleList(Block(cfg) if index < cfg.dense_layers else MoEBlock(cfg)
                                    for index in range(cfg.num_layers))
        self.head = Head(cfg, self.padded_vocab)
        if cfg.tied_embeddings:
            self.head.proj.weight = self.embed.tok.weight


# The routed experts of a MoE block, relative to the block (what expert parallelism shards).
EXPERTS_MODULE = "moe.experts"
