"""Shapes of the built-in decoder-only transformers; torch-free so specs parse without importing torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerConfig:
    family: str  # "gpt" or "llama"
    num_layers: int
    hidden: int
    num_heads: int
    vocab: int
    ffn: int = 0  # 0: 4 * hidden
    num_kv_heads: int = 0  # 0: num_heads
    max_positions: int = 1024  # learned positions (GPT); ignored by Llama (RoPE)
    tied_embeddings: bool = True
    vocab_multiple: int = 128  # Megatron-LM pads the vocabulary to a multiple of 128 * tp
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self):
        for name in ("num_layers", "hidden", "num_heads", "vocab", "max_positions", "vocab_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.family not in ("gpt", "llama"):
            raise ValueError(f"family must be 'gpt' or 'llama', got {self.family!r}")
        if self.hidden % self.num_heads:
            raise ValueError(f"heads ({self.num_heads}) must divide hidden ({self.hidden})")
        if self.ffn < 0 or self.num_kv_heads < 0:
            raise ValueError("ffn and kv_heads must be >= 0")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.num_heads})")
        if self.family == "llama" and (self.hidden // self.num_heads) % 2:
            raise ValueError(f"RoPE needs an even head dim, got hidden/heads = {self.hidden // self.num_heads}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def padded_vocab(self, tp: int = 1) -> int:
        multiple = self.vocab_multiple * tp
        return -(-self.vocab // multiple) * multiple
