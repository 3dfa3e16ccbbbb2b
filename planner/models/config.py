"""Shapes of the built-in decoder-only transformers; torch-free so specs parse without importing torch."""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.contracts.errors import MeshplanError

FAMILIES = ("gpt", "llama", "moe")


@dataclass(frozen=True)
class TransformerConfig:
    """A zoo model's shape. `moe` is the Llama block with its MLP replaced by routed experts
    (`planner.models.moe`); the MoE fields are zero for `gpt` and `llama`."""

    family: str  # "gpt", "llama" or "moe"
    num_layers: int
    hidden: int
    num_heads: int
    vocab: int
    ffn: int = 0  # 0: 4 * hidden; for "moe": the width of the first `dense_layers` blocks' MLP
    num_kv_heads: int = 0  # 0: num_heads
    max_positions: int = 1024  # learned positions (GPT); ignored by Llama (RoPE)
    # RoPE families: the context length the model was trained for (its config's
    # max_position_embeddings); 0 for parametric specs, which state none
    context_length: int = 0
    tied_embeddings: bool = True
    vocab_multiple: int = 128  # Megatron-LM pads the vocabulary to a multiple of 128 * tp
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attn_head_dim: int = 0  # 0: hidden / heads; Qwen3 fixes 128 whatever hidden / heads is
    qkv_bias: bool = False  # biases on the q, k, v Linears (Qwen2); GPT has biases everywhere anyway
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    num_experts: int = 0  # "moe": routed experts per MoE block
    top_k: int = 0  # "moe": experts each token is routed to
    expert_ffn: int = 0  # "moe": SwiGLU width of one routed expert
    num_shared_experts: int = 0  # "moe": experts every token goes through (one SwiGLU of their summed width)
    shared_expert_ffn: int = 0  # "moe": width of one shared expert; 0: expert_ffn
    shared_expert_gate: bool = False  # "moe": sigmoid gate Linear(hidden, 1) on the shared output (Qwen2-MoE)
    dense_layers: int = 0  # "moe": leading blocks with a dense SwiGLU of width `ffn` instead of experts
    # "moe": weight of the load-balancing loss in the training objective (`planner.models.moe`:
    # loss = cross entropy + aux_loss_coef * mean over MoE blocks of E * sum_e f_e P_e); 0 turns it
    # off; ignored by gpt and llama
    aux_loss_coef: float = 0.01

    def __post_init__(self):
        for name in ("num_layers", "hidden", "num_heads", "vocab", "max_positions", "vocab_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if not self.attn_head_dim and self.hidden % self.num_heads:
            raise ValueError(f"heads ({self.num_heads}) must divide hidden ({self.hidden})")
        if not isinstance(self.context_length, int) or self.context_length < 0:
            raise ValueError(f"context_length must be an integer >= 0, got {self.context_length!r}")
        if self.ffn < 0 or self.num_kv_heads < 0 or self.attn_head_dim < 0:
            raise ValueError(f"ffn, kv_heads and head_dim must be >= 0, got {self.ffn}, {self.num_kv_heads}, "
                             f"{self.attn_head_dim}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.num_heads})")
        if self.family != "gpt" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {self.head_dim}")
        if self.family == "gpt" and (self.attn_head_dim or self.qkv_bias or self.qk_norm):
            raise ValueError("head_dim, qkv_bias and qk_norm are Llama-style options; gpt has none of them")
        self._check_moe()

    def _check_moe(self) -> None:
        moe_fields = ("num_experts", "top_k", "expert_ffn", "num_shared_experts", "shared_expert_ffn", "dense_layers")
        for name in moe_fields:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.family != "moe":
            if any(getattr(self, name) for name in moe_fields) or self.shared_expert_gate:
                raise ValueError(f"expert settings need the moe family, got family {self.family!r}")
            return
        if self.num_experts < 1 or self.expert_ffn < 1:
            raise ValueError(f"a moe model needs experts >= 1 and expert_ffn >= 1, got experts={self.num_experts}, "
                             f"expert_ffn={self.expert_ffn}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be between 1 and experts ({self.num_experts}), got {self.top_k}")
        if self.dense_layers >= self.num_layers:
            raise ValueError(f"dense_layers ({self.dense_layers}) must leave at least one MoE block of "
                             f"{self.num_layers}")
        if self.dense_layers and not self.ffn:
            raise ValueError(f"dense_layers={self.dense_layers} needs ffn, the dense blocks' SwiGLU width")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ValueError("shared_expert_gate needs shared experts")
        if not isinstance(self.aux_loss_coef, (int, float)) or not 0 <= self.aux_loss_coef < float("inf"):
            raise ValueError(f"aux_loss_coef must be a finite number >= 0, got {self.aux_loss_coef!r}")

    @property
    def position_limit(self) -> int:
        """Longest sequence the model takes: GPT's learned positions, else the trained context (0: none)."""
        return self.max_positions if self.family == "gpt" else self.context_length

    def check_seq(self, spec: str, seq: int) -> None:
        """Refuse a sequence beyond GPT's learned positions, with the limit (the one rule for every
        zoo model). Rotary models take longer sequences (context extension, as torchtitan's 256K
        Llama 3.1 8B runs do): `context_note` says so instead."""
        if self.family == "gpt" and seq > self.max_positions:
            raise MeshplanError(f"sequence length {seq} exceeds the {self.max_positions} learned positions of "
                                f"{spec!r}; use --seq <= {self.max_positions} or a parametric gpt: spec")

    def context_note(self, spec: str, seq: int) -> str:
        """A line when `seq` is beyond the context a rotary model was trained for ("" otherwise)."""
        if self.family == "gpt" or not self.context_length or seq <= self.context_length:
            return ""
        return (f"note: {spec} was trained on up to {self.context_length} positions; --seq {seq} assumes its "
                "rotary embedding extended (context extension), costed as the same model")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.hidden // self.num_heads

    @property
    def shared_ffn_dim(self) -> int:
        """Width of the one SwiGLU that holds all shared experts (0 without them)."""
        return self.num_shared_experts * (self.shared_expert_ffn or self.expert_ffn)

    def padded_vocab(self, tp: int = 1) -> int:
        multiple = self.vocab_multiple * tp
        return -(-self.vocab // multiple) * multiple


def check_capacity(capacity_factor_value, pad: bool = False) -> None:
    """ValueError unless the capacity factor is None/0 (none) or a finite number > 0, and padding
    comes with a capacity factor."""
    if capacity_factor_value is None:
        capacity_factor_value = 0.0
    if isinstance(capacity_factor_value, bool) or not isinstance(capacity_factor_value, (int, float)) \
            or not 0.0 <= capacity_factor_value < float("inf"):
        raise ValueError(f"moe capacity factor must be a finite number > 0, got {capacity_factor_value!r}")
    if pad and not capacity_factor_value:
        raise ValueError("padding expert inputs to capacity needs a capacity factor")
