"""Saved-tensor hooks that keep a tensor autograd would save as a reference, rebuilt in backward.

Used where a module's backward needs a tensor that is cheap to make again from something kept
anyway: sequence parallelism's gathered input (`tensor_parallel._Region`, from the sequence
shard), the attention output with its heads merged (`transformer.Attention`, from the
kernel's output) and an RMSNorm's output (`transformer.normed_call`, from the norm's input).
Each is rebuilt once per backward and shared by every module that saved it. A saved tensor is matched by its storage, so the views autograd saves of it
(a Linear's 2-D view of its 3-D input, a DTensor around it) all come back as the same views of
the rebuilt tensor.

Hooks nest: `SavedReference.saving()` hands every tensor it does not keep by reference to the
hooks that were active when it was entered (torch's activation checkpointing, the profiler's
recorder, another reference further out), so a reference inside a checkpointed layer or inside
another reference's region changes nothing else that is saved. A reference's own source tensor
can be kept the same way (`SavedOutside`): a sequence-parallel region keeps its shard through a
reference to the norm that made it.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


def storage_id(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage, views included (also on the meta device, where every
    data pointer is 0)."""
    return tensor.untyped_storage()._cdata


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return tensor if local is None else local


def _active_hooks():
    """The (pack, unpack) pair autograd would use now, or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _Outer:
    """A tensor packed by the hooks outside a reference's region."""

    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class SavedOutside:
    """One tensor kept as the hooks active at construction would save it for backward (a
    reference rebuilds it, activation checkpointing recomputes it, no hooks: the tensor itself);
    `get()` gives it back, once or many times."""

    def __init__(self, tensor: torch.Tensor):
        self.hooks = _active_hooks()
        self.packed = tensor if self.hooks is None else self.hooks[0](tensor)
        self.tensor = None

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = self.packed if self.hooks is None else self.hooks[1](self.packed)
        return self.tensor

    def release(self) -> None:
        """Drop the unpacked tensor (the packed form stays for a later `get`)."""
        self.tensor = None


class SavedReference:
    """`pack` / `unpack` for `torch.autograd.graph.saved_tensors_hooks`: tensors in the storage of
    `target` are saved as (shape, stride, offset[, DTensor spec]); everything else is saved as it
    is. In backward the first reference unpacked calls `make()`, a tensor with `target`'s layout
    (the `make` function given, or a subclass's method: not a function that closes over the
    instance, a cycle that would keep what the reference holds alive after backward, until
    Python's collector runs); every reference saved shares it, and it is dropped once the last
    one is unpacked. Subclasses may watch the references saved (`packed`)."""

    def __init__(self, target: torch.Tensor, make: Callable[[], torch.Tensor] | None = None):
        self.target_id, self._make = storage_id(target), make
        self.pending = 0  # references saved and not yet unpacked
        self.rebuilt = None  # the rebuilt tensor while some are pending

    def make(self) -> torch.Tensor:
        return self._make()

    def packed(self) -> None:
        """Called once per reference saved."""

    @contextlib.contextmanager
    def saving(self):
        """`saved_tensors_hooks` with `pack` / `unpack`, chained to the hooks active outside."""
        outer = _active_hooks()

        def pack(tensor):
            packed = self.pack(tensor)
            if packed is tensor and outer is not None:
                return _Outer(outer[0](tensor))
            return packed

        def unpack(packed):
            if isinstance(packed, _Outer):
                return outer[1](packed.packed)
            return self.unpack(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield self

    def pack(self, tensor):
        from torch.distributed.tensor import DTensor

        local = local_tensor(tensor)
        if storage_id(local) != self.target_id:
            return tensor
        self.pending += 1
        self.packed()
        spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()) if isinstance(tensor, DTensor) else None
        return (self, local.shape, local.stride(), local.storage_offset(), spec)

    def unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is self):
            return packed
        _, shape, stride, offset, spec = packed
        if self.rebuilt is None:
            self.rebuilt = self.make()
        view = self.rebuilt.as_strided(shape, stride, offset)
        self.pending -= 1
        if self.pending == 0:
            self.rebuilt = None  # the last saver has its view: free the shared copy
        if spec is None:
            return view
        from torch.distributed.tensor import DTensor

        mesh, placements, global_shape, global_stride = spec
        return DTensor.from_local(view, mesh, placements, run_check=False, shape=global_shape, stride=global_stride)
