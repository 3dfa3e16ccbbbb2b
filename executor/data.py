"""Training batches: synthetic tokens drawn from the seed, or a text file read as bytes.

Every rank computes the same global batch for a step and keeps its data-parallel slice, so a
run's data depends only on (seed, step) and never on the layout: that is what lets any plan be
compared against single-process training, and lets a resumed run pick up at the same position.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError

BYTE_VOCAB = 256  # the byte tokenizer: token = byte value


@dataclass(frozen=True)
class DataSource:
    """Where batches come from: `path=None` is synthetic tokens below `vocab`."""

    vocab: int
    seq: int
    seed: int
    path: str | None = None

    def __post_init__(self):
        if self.vocab <= 0 or self.seq <= 0:
            raise ValueError(f"vocab ({self.vocab}) and seq ({self.seq}) must be positive")


def token_vocab(spec: str, seq: int) -> int | None:
    """The vocabulary token batches are drawn from: the zoo's (as published) or a Hugging Face
    config's; None for file models, which train on batches shaped like their example inputs."""
    from meshplan.planner.models.registry import hf_config_path, parse_spec
    from meshplan.planner.models.hf import hf_vocab

    config = parse_spec(spec, seq)
    if config is not None:
        return config.vocab
    config_path = hf_config_path(spec)
    if config_path is not None:  # the config alone: building the model here would be work thrown away
        return hf_vocab(config_path)
    return None


def make_source(data: str, vocab: int, seq: int, seed: int) -> DataSource:
    """Check a `--data` argument before any process starts."""
    if data == "synthetic":
        return DataSource(vocab=vocab, seq=seq, seed=seed)
    path = Path(data)
    if not path.is_file():
        raise MeshplanError(f"--data {data!r} is neither 'synthetic' nor a readable text file")
    if vocab < BYTE_VOCAB:
        raise MeshplanError(f"--data {data}: the byte tokenizer needs a vocabulary of at least {BYTE_VOCAB} "
                            f"tokens, the model has {vocab}; use a model with vocab>={BYTE_VOCAB}")
    size_bytes = path.stat().st_size
    if size_bytes < seq + 2:
        raise MeshplanError(f"--data {data}: {size_bytes} bytes is too short for sequences of {seq} tokens; "
                            f"need at least {seq + 2} bytes")
    return DataSource(vocab=vocab, seq=seq, seed=seed, path=str(path.resolve()))


def global_batch(source: DataSource, step: int, num_samples: int):
    """(inputs, targets), each (num_samples, seq) int64, for 0-based optimizer step `step`."""
    import torch

    if source.path is None:
        # One generator per step: the batch of step k does not depend on earlier steps.
        generator = torch.Generator().manual_seed(source.seed * 1_000_003 + step)
        tokens = torch.randint(0, source.vocab, (num_samples, source.seq + 1), generator=generator)
    else:
        tokens = _text_windows(source, step, num_samples)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _text_windows(source: DataSource, step: int, num_samples: int):
    """Consecutive windows of seq+1 bytes; sample i of step k starts at (k * n + i) * seq (wrapping)."""
    import torch

    raw = Path(source.path).read_bytes()
    span = len(raw) - source.seq - 1
    starts = [((step * num_samples + i) * source.seq) % span for i in range(num_samples)]
    rows = [list(raw[start:start + source.seq + 1]) for start in starts]
    return torch.tensor(rows, dtype=torch.long)


def replica_slice(inputs, targets, dp_rank: int, dp: int):
    """The contiguous block of samples data-parallel replica `dp_rank` trains on."""
    per_replica = inputs.shape[0] // dp
    rows = slice(dp_rank * per_replica, (dp_rank + 1) * per_replica)
    return inputs[rows], targets[rows]
