"""The unit every pipeline schedule is written in: one compute action of one micro-batch."""
from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    """One compute action of one micro-batch of one model chunk: its forward (F), full backward
    (B), or a backward split into the input gradient (I) and, later, the weight gradient (W)."""

    kind: str  # "F", "B", "I" or "W"
    chunk: int  # model chunk index (torch's stage index; its rank: contracts.config.chunk_rank)
    microbatch: int
    # True on the forward of a DualPipeV "F;B" pair: the next action (its backward) runs right
    # after it, and both outputs are sent when the pair ends.
    overlap: bool = False

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind}{self.microbatch}"

    @property
    def frees_activations(self) -> bool:
        """The chunk's saved activations of this micro-batch are released when this action ends:
        the full backward, or W (torch's I keeps the whole autograd graph, retain_graph=True)."""
        return self.kind in ("B", "W")


_tuple_new = tuple.__new__


def new_action(kind: str, chunk: int, microbatch: int, overlap: bool = False) -> Action:
    """`Action(kind, chunk, microbatch, overlap)` without NamedTuple's Python-level constructor: the
    schedule generators make hundreds of thousands for a search."""
    return _tuple_new(Action, (kind, chunk, microbatch, overlap))
