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
the shared gate). The load-balancing loss of training engines is not part of this model.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from meshplan.planner.models.config import TransformerConfig
from meshplan.planner.models.transformer import (MLP, Attention, Block, CausalLM, Embedding, Head, RMSNorm,
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
        probs = self.gate(x).float().softmax(dim=-1)  # (tokens, experts), fp32 as engines route
        if x.is_meta:
            # Balanced routing (module docstring): copy i of the flattened (tokens, k) goes to i mod E.
            slots = torch.arange(x.shape[0] * self.top_k, device=x.device).view(-1, self.top_k)
            experts = slots % self.num_experts
            weights = probs.gather(1, experts)
        else:
            weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.type_as(x), experts


class GroupedLinear(nn.Module):
    """One Linear per expert, weights stacked as (experts, in, out); rows arrive grouped by expert."""

    def __init__(self, num_experts: int, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, in_dim, out_dim))
        if not self.weight.is_meta:
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # x: (sum(counts), in), rows of expert e contiguous; one (count_e, in) @ (in, out) each.
        groups = x.split(counts)
        return torch.cat([group @ self.weight[expert] for expert, group in enumerate(groups)])


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLUs: down(silu(gate(x)) * up(x)) per expert group."""

    def __init__(self, num_experts: int, hidden: int, expert_ffn: int):
        super().__init__()
        self.gate = GroupedLinear(num_experts, hidden, expert_ffn)
        self.up = GroupedLinear(num_experts, hidden, expert_ffn)
        self.down = GroupedLinear(num_experts, expert_ffn, hidden)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self.down(_FusedSwiGLU.apply(self.gate(x, counts), self.up(x, counts)), counts)


def _swiglu(cfg: TransformerConfig, width: int) -> MLP:
    """The zoo's fused SwiGLU (gate, up -> down) of `width`."""
    return MLP(replace(cfg, ffn=width))


class MoE(nn.Module):
    """Router -> dispatch -> routed experts -> combine, plus shared experts; (batch, seq, h) in and out."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = TopKRouter(cfg.hidden, cfg.num_experts, cfg.top_k)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden, cfg.expert_ffn)
        self.shared = _swiglu(cfg, cfg.shared_ffn_dim) if cfg.num_shared_experts else None
        self.shared_gate = nn.Linear(cfg.hidden, 1, bias=False) if cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        out = self.shared_out(tokens) if self.shared is not None else None
        routed = self.routed_out(tokens)
        out = routed if out is None else out + routed
        return out.view(x.shape)

    def shared_out(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.shared(tokens)
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(tokens)) * out
        return out

    def routed_out(self, tokens: torch.Tensor) -> torch.Tensor:
        weights, experts = self.router(tokens)
        flat_experts = experts.flatten()  # (tokens * k,): copy i is token i // k, choice i % k
        order = flat_experts.argsort(stable=True)  # routed copies grouped by expert
        token_of_copy = order // self.top_k
        counts = self.expert_counts(flat_experts, tokens.is_meta)
        dispatched = tokens.index_select(0, token_of_copy)  # dispatch: (tokens * k, h) in expert order
        expert_out = self.experts(dispatched, counts)
        weighted = expert_out * weights.flatten().index_select(0, order).unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token_of_copy, weighted)  # combine

    def expert_counts(self, flat_experts: torch.Tensor, meta: bool) -> list[int]:
        num_experts = self.router.num_experts
        if meta:
            return balanced_counts(flat_experts.numel(), num_experts)
        return torch.bincount(flat_experts, minlength=num_experts).tolist()


class MoEBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


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
