"""Saved-tensor hooks that keep a tensor autograd would save as a reference, rebuilt in backward.

Used where a module's backward needs a tensor that is cheap to make again from something kept
anyway: sequence parallelism's gathered input (`tensor_parallel._Region`, from the sequence
shard) and the attention output with its heads merged (`transformer.Attention`, from the
kernel's output). A saved tensor is matched by its storage, so the views autograd saves of it
(a Linear's 2-D view of its 3-D input, a DTensor around it) all come back as the same views of
the rebuilt tensor.
"""
from __future__ import annotations

from typing import Callable

import torch


def storage_id(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage, views included (also on the meta device, where every
    data pointer is 0)."""
    return tensor.untyped_storage()._cdata


class SavedReference:
    """`pack` / `unpack` for `torch.autograd.graph.saved_tensors_hooks`: tensors in the storage of
    `target` are saved as (shape, stride, offset[, DTensor spec]) and rebuilt in backward from
    `rebuild()`, a tensor with `target`'s layout; everything else is saved as it is. Subclasses
    may count the references (`packed`, `unpacked`)."""

    def __init__(self, target: torch.Tensor, rebuild: Callable[[], torch.Tensor]):
        self.target_id, self.rebuild = storage_id(target), rebuild

    def packed(self) -> None:
        """Called once per reference saved."""

    def unpacked(self) -> None:
        """Called once per reference rebuilt."""

    def pack(self, tensor):
        from torch.distributed.tensor import DTensor

        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if storage_id(local) != self.target_id:
            return tensor
        self.packed()
        spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()) if isinstance(tensor, DTensor) else None
        return (self, local.shape, local.stride(), local.storage_offset(), spec)

    def unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is self):
            return packed
        _, shape, stride, offset, spec = packed
        view = self.rebuild().as_strided(shape, stride, offset)
        self.unpacked()
        if spec is None:
            return view
        from torch.distributed.tensor import DTensor

        mesh, placements, global_shape, global_stride = spec
        return DTensor.from_local(view, mesh, placements, run_check=False, shape=global_shape, stride=global_stride)
