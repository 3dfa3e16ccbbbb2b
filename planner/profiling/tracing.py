"""One instrumented training step on the meta device: FLOPs and saved bytes per layer.

How each figure is measured (no formulas):

- FLOPs: one `FlopCounterMode` around forward + backward. Layer boundaries read its running
  total: a layer's forward starts when its first module is called (forward pre-hook), its
  backward ends when the gradient of its input is ready (tensor hook on that input). Every op
  lands in exactly one layer, so per-layer sums equal the counter's total; backward FLOPs are
  thereby (forward + backward count) minus the forward count, per layer.
- Activation bytes: `saved_tensors_hooks` sees every tensor autograd keeps for backward. Bytes
  are counted once per storage per layer (q, k and v Linears all save the same normed input),
  parameters and buffers excluded, and classified by where they were saved (see `_classify`).
- Attention: SDPA on the meta device runs torch's math path, which saves fp32 copies of q, k, v
  and the fp32 softmax of shape (heads, s, s). With attention="flash" those saved tensors are
  replaced by what a fused kernel keeps: q, k, v as passed, the output and an fp32 log-sum-exp
  of shape (heads, s). Under grouped-query attention (`enable_gqa=True`) K and V are passed,
  and so counted, at kv heads; the math path expands them to q heads inside and is measured
  with that expansion. FlopCounterMode counts SDPA in full (non-causal), the model-FLOPs
  convention, at q heads with or without `enable_gqa` (4 * b * s^2 * heads * head_dim forward:
  the math path's matmuls run on the expanded K and V); the causal saving is reported separately.
- Routed experts (a group's `expert_modules`): their forward FLOPs run from the module's call to
  its return, their backward FLOPs from the gradient of its output to the gradient of its input
  (autograd runs a chain's nodes in reverse creation order, so nothing else runs in between); the
  bytes saved while they run, and the bytes of the dispatched tokens they are called with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from meshplan.planner.contracts.attention import is_fused
from meshplan.planner.contracts.errors import MeshplanError

_ATTENTION_ARG_NAMES = ("query", "key", "value")


@dataclass(frozen=True)
class LayerMeasurement:
    """What one step of one layer group costs, per sample (the example inputs hold one sample)."""

    fwd_flops: int
    bwd_flops: int
    causal_saving_flops: int  # forward FLOPs a causal attention kernel skips
    act_tp_sharded_bytes: int
    act_tp_replicated_bytes: int
    act_attn_score_bytes: int
    input_bytes: int
    output_bytes: int
    input_shapes: tuple  # shapes and dtypes of the positional tensor inputs (structure key)
    called: bool  # False: the module never ran in forward
    expert_fwd_flops: int = 0  # routed experts' share of fwd_flops
    expert_bwd_flops: int = 0  # and of bwd_flops
    expert_act_bytes: int = 0  # bytes saved inside the routed experts (part of the three kinds above)
    dispatch_bytes: int = 0  # the dispatched tokens the routed experts are called with
    conv_fwd_flops: int = 0  # convolutions' share of fwd_flops
    attn_fwd_flops: int = 0  # the attention core's (SDPA's) share of fwd_flops
    conv_bwd_flops: int = 0  # and of bwd_flops
    act_rebuilt_bytes: int = 0  # saved as references, rebuilt in backward (not in the three kinds)


def measure_layers(built: Any, groups: tuple, attention: str = "flash",
                   backward: bool = True) -> tuple[list[LayerMeasurement], list[int]]:
    """Run forward (+ loss + backward) of `built` once; return per-group measurements and the
    group indices in the order they were first called."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from meshplan.planner.profiling.op_audit import flop_formulas, op_audit_mode

    recorder = _Recorder(groups, attention, _storage_keys(built.module))
    handles = recorder.install()
    # The zoo's o Linear keeps a reference to the attention output in place of its heads-merged
    # copy. A flash kernel keeps that output anyway (flash mode records it); torch's math path,
    # which the meta device runs, does not: there the reference holds the copy's bytes, and the
    # trace sees them by saving the copy itself.
    from meshplan.planner.models.transformer import Attention, _NormOutput

    by_reference = Attention.merged_heads_by_reference
    Attention.merged_heads_by_reference = is_fused(attention)
    _NormOutput.observers.append(recorder.rebuilt)
    try:
        with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter, \
                op_audit_mode(counter.flop_registry, counter) as audit, _AttentionMode(recorder), \
                torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack):
            recorder.counter, recorder.audit = counter, audit
            output = _user_call(built, "forward", built.run_forward)
            roots = _backward_roots(built, output) if backward else []
            recorder.start_backward()
            if roots:
                _user_call(built, "backward", lambda: torch.autograd.backward(
                    roots, [torch.ones_like(root) for root in roots]))
            recorder.switch(recorder.current)
    finally:
        Attention.merged_heads_by_reference = by_reference
        _NormOutput.observers.remove(recorder.rebuilt)
        for handle in handles:
            handle.remove()
    if audit.uncounted:
        ops = ", ".join(sorted(audit.uncounted))
        raise MeshplanError(f"the model runs {ops}, which meshplan's FLOP counter has no formula for and does not "
                            "know to be FLOP-free, so its cost would be a silent zero; write that operation in "
                            "the model as matmuls or elementwise torch operations, or profile a model without it")
    return recorder.results(), list(recorder.order)


def _unpack(tensor):
    return tensor


def _user_call(built: Any, what: str, fn: Callable):
    """Run user-supplied model code; its failures are the user's to fix (exit 2, one line)."""
    if built.info.family not in ("file", "hf"):
        return fn()
    try:
        return fn()
    except MeshplanError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure (even sys.exit) is bad input
        raise MeshplanError(f"the model cannot run its {what} on the meta device ({type(exc).__name__}: "
                            f"{_first_line(exc)}){_meta_hint(exc)}") from exc


def _first_line(exc: BaseException, limit: int = 300) -> str:
    lines = str(exc).strip().splitlines()
    text = " ".join(lines[0].split()) if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def _meta_hint(exc: BaseException) -> str:
    """What to change, when the error says the meta device met a value-dependent operation."""
    text = str(exc)
    if any(word in text for word in ("nonzero", "data-dependent", "Cannot copy out of meta tensor",
                                      "_local_scalar_dense", ".item()", "data dependent")):
        return ("; the meta device has shapes but no values, so operations whose result depends on values "
                "(.item(), nonzero(), masks whose size depends on data) cannot run")
    return ""


def _backward_roots(built: Any, output) -> list:
    """The loss when the model has one, else every float output (backward with ones)."""
    import torch
    from torch.utils._pytree import tree_leaves

    if built.loss_fn is not None:
        loss = _user_call(built, "loss_fn", lambda: built.loss_fn(output, built.example_inputs))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise MeshplanError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        return [loss] if loss.requires_grad else []
    return [leaf for leaf in tree_leaves(output)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point()]


def _storage_key(tensor) -> tuple[Any, int]:
    """(identity of the storage, its bytes): views of one storage count once."""
    try:
        storage = tensor.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):  # sparse or storage-less subclass
        return ("tensor", id(tensor)), tensor.numel() * tensor.element_size()


def _storage_keys(module) -> set:
    keys = {_storage_key(p)[0] for p in module.parameters()}
    return keys | {_storage_key(b)[0] for b in module.buffers()}


def _routed_copy_bytes(args) -> int:
    """Bytes of the routed copies an experts module is called with (`LayerProfile.dispatch_bytes`:
    tokens * top_k * hidden elements).

    Modules that take the copies already expanded (one row per token and expert) pass them as
    they are. transformers' experts (`experts_implementation` eager, batched_mm or grouped_mm)
    take each token once, (tokens, hidden), beside its routing, a (tokens, top_k) integer index:
    the dispatch an engine runs sends a copy per chosen expert (Megatron-Core's alltoall
    dispatcher permutes tokens * top_k rows before its all-to-all), so the token rows count top_k
    times, top_k read from the index whose rows match theirs. The index and the routing weights
    are metadata, not copies."""
    import torch
    from torch.utils._pytree import tree_leaves

    tensors = [leaf for leaf in tree_leaves(args) if isinstance(leaf, torch.Tensor)]
    floats = [t for t in tensors if t.is_floating_point() and t.dim() >= 2]
    if not floats:
        return _tensor_bytes(args)[0]
    tokens = max(floats, key=lambda t: t.numel())
    rows = tokens.numel() // tokens.shape[-1]
    copies_per_row = next((t.numel() // rows for t in tensors
                           if not t.is_floating_point() and t.dim() >= 2 and t.numel() % rows == 0
                           and t.numel() // t.shape[-1] == rows), 1)
    return tokens.numel() * tokens.element_size() * copies_per_row


def _tensor_bytes(value) -> tuple[int, tuple]:
    """Bytes and (shape, dtype) signature of the tensors in a value, each storage once."""
    import torch
    from torch.utils._pytree import tree_leaves

    seen, total, sig = set(), 0, []
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            sig.append((tuple(leaf.shape), str(leaf.dtype)))
            key = _storage_key(leaf)[0]
            if key not in seen:
                seen.add(key)
                total += leaf.numel() * leaf.element_size()
    return total, tuple(sig)


class _Recorder:
    """Mutable state of one measurement run (lives only inside `measure_layers`)."""

    def __init__(self, groups: tuple, attention: str, param_keys: set):
        count = len(groups)
        self.groups, self.attention, self.param_keys = groups, attention, param_keys
        self.counter = self.audit = None
        self.current, self.mark, self.conv_mark, self.in_backward = 0, 0, 0, False
        self.fwd, self.bwd, self.causal = [0] * count, [0] * count, [0] * count
        self.conv_fwd, self.conv_bwd, self.attn_fwd = [0] * count, [0] * count, [0] * count
        self.saved: list[dict] = [{} for _ in range(count)]
        self.inputs: list[tuple[int, tuple]] = [(0, ())] * count
        self.outputs = [0] * count
        self.order: list[int] = []
        self.stack: list[Any] = []
        self.score_shape: tuple | None = None  # (s_q, s_kv) while inside math SDPA
        self.muted = 0  # > 0 while inside SDPA under attention="flash"
        self.alive: list[Any] = []  # recorded tensors (meta: no memory), see `record`
        self.roles = self._linear_roles()
        # Routed experts: id(module) of each group's, and per group FLOPs, saved storages, dispatch bytes.
        self.expert_ids = {id(group.modules[0].get_submodule(name))
                           for group in groups for name in group.expert_modules}
        self.expert_fwd, self.expert_bwd, self.dispatch = [0] * count, [0] * count, [0] * count
        self.expert_saved: list[set] = [set() for _ in range(count)]
        self.expert_mark = 0

    def _linear_roles(self) -> dict[int, str]:
        """id(module) -> "column" | "row" | "region" for the Linears a block split names."""
        roles: dict[int, str] = {}
        for group in self.groups:
            split, root = group.tp_split, group.modules[0]
            if split.kind != "block":
                continue
            for role, names in (("column", split.column_linears), ("row", split.row_linears)):
                for name in names:
                    roles[id(root.get_submodule(name))] = role
                    parent = name.rpartition(".")[0]
                    if parent:
                        roles.setdefault(id(root.get_submodule(parent)), "region")
        return roles

    def install(self) -> list:
        handles = []
        for index, group in enumerate(self.groups):
            for root in group.modules:
                handles.append(root.register_forward_pre_hook(self._boundary_hook(index)))
                handles.append(root.register_forward_hook(self._output_hook(index)))
                for sub in root.modules():
                    handles.append(sub.register_forward_pre_hook(self._push))
                    handles.append(sub.register_forward_hook(self._pop, always_call=True))
            for name in group.expert_modules:
                experts = group.modules[0].get_submodule(name)
                handles.append(experts.register_forward_pre_hook(self._expert_start(index)))
                handles.append(experts.register_forward_hook(self._expert_end(index)))
        return handles

    def _total(self) -> int:
        return self.counter.get_total_flops() if self.counter is not None else 0

    def _expert_start(self, index: int):
        import torch

        def hook(module, args):
            self.expert_mark = self._total()
            self.dispatch[index] += _routed_copy_bytes(args)
            tokens = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
            if tokens is not None and torch.is_grad_enabled():
                # backward through the experts ends when the dispatched tokens' gradient is ready
                tokens.register_hook(lambda grad: self._add_expert_bwd(index))
        return hook

    def _expert_end(self, index: int):
        import torch

        def hook(module, args, output):
            self.expert_fwd[index] += self._total() - self.expert_mark
            if isinstance(output, torch.Tensor) and output.requires_grad and torch.is_grad_enabled():
                output.register_hook(self._mark_expert_bwd)
        return hook

    def _mark_expert_bwd(self, grad) -> None:
        self.expert_mark = self._total()

    def _add_expert_bwd(self, index: int) -> None:
        self.expert_bwd[index] += self._total() - self.expert_mark

    def switch(self, index: int) -> None:
        """Close the running layer's FLOP interval at the counter's total; `index` runs next."""
        total = self.counter.get_total_flops() if self.counter is not None else 0
        conv = self.audit.conv_flops if self.audit is not None else 0
        (self.bwd if self.in_backward else self.fwd)[self.current] += total - self.mark
        (self.conv_bwd if self.in_backward else self.conv_fwd)[self.current] += conv - self.conv_mark
        self.mark, self.conv_mark, self.current = total, conv, index

    def start_backward(self) -> None:
        self.switch(self.current)
        self.in_backward = True

    def _boundary_hook(self, index: int):
        import torch

        def hook(module, args):
            previous, first_call = self.current, index not in self.order
            if previous != index or first_call:
                self.switch(index)
                grad_input = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
                if grad_input is not None and torch.is_grad_enabled():
                    # Its gradient is complete once this layer's backward is done.
                    grad_input.register_hook(lambda grad: self.switch(previous))
            if first_call:
                self.order.append(index)
                self.inputs[index] = _tensor_bytes(args)
        return hook

    def _output_hook(self, index: int):
        def hook(module, args, output):
            self.outputs[index] = _tensor_bytes(output)[0]
        return hook

    def _push(self, module, args):
        self.stack.append(module)

    def _pop(self, module, args, output):
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    def pack(self, tensor):
        if not self.in_backward and not self.muted:
            self.record(tensor, self._classify(tensor))
        return tensor

    def rebuilt(self, reference) -> None:
        """A saved tensor kept as a reference (`transformer.normed_call`): its bytes, once per layer."""
        if not self.in_backward and not self.muted:
            # keyed by the reference, kept alive: the storage it points to is freed after the
            # forward, and its address may come back as the next norm's output
            self.alive.append(reference)
            self.record(None, "rebuilt", key=("rebuilt", id(reference)), nbytes=reference.nbytes)

    def record(self, tensor, kind: str, key=None, nbytes: int = 0) -> None:
        if key is None:
            key, nbytes = _storage_key(tensor)
            # Storage identities are addresses: keep every recorded tensor alive so that a
            # storage freed later (flash mode records q, k, v that the math path does not keep)
            # cannot be reused under the same key by another tensor.
            self.alive.append(tensor)
        if key in self.param_keys:
            return
        saved = self.saved[self.current]
        if key in saved:
            return
        saved[key] = (kind, nbytes)
        if self.expert_ids and any(id(module) in self.expert_ids for module in self.stack):
            self.expert_saved[self.current].add(key)

    def _classify(self, tensor) -> str:
        """"score" (s x s attention), "sharded" (inside the TP region) or "replicated".

        Block layers: a column Linear saves its (replicated) input; a row Linear and everything
        inside attention/MLP save sharded tensors; norms and residual glue are replicated. Layers
        that cannot be split ("none") keep everything but attention scores replicated. Head:
        saved inside its modules (norm, output Linear input) is replicated, the loss on the
        vocab-sharded logits after them is sharded. Everything else is replicated.
        """
        group = self.groups[self.current]
        if self.score_shape is not None:
            if tensor.dim() >= 2 and tuple(tensor.shape[-2:]) == self.score_shape:
                return "score"
            return "sharded" if group.tp_split.kind == "block" else "replicated"
        if group.tp_split.kind == "block":
            for module in reversed(self.stack):
                role = self.roles.get(id(module))
                if role == "column":
                    return "replicated"
                if role is not None:
                    return "sharded"
            return "replicated"
        if group.tp_split.kind == "vocab" and group.kind == "head" and not self.stack:
            return "sharded"
        return "replicated"

    def attention_call(self, func, args, kwargs):
        import torch

        named = [kwargs[name] for name in _ATTENTION_ARG_NAMES if name in kwargs]
        query, key, value = (tuple(args) + tuple(named))[:3]
        is_causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
        window = key.shape[-2] if is_causal else self._hf_window(key)
        start = self.counter.get_total_flops() if self.counter is not None else 0
        flash = is_fused(self.attention)
        if flash:
            self.muted += 1
        else:
            self.score_shape = (query.shape[-2], key.shape[-2])
        try:
            out = func(*args, **kwargs)
        finally:
            if flash:
                self.muted -= 1
            else:
                self.score_shape = None
        flops = (self.counter.get_total_flops() if self.counter is not None else 0) - start
        seq_q = query.shape[-2]
        if not self.in_backward:
            self.attn_fwd[self.current] += flops
        # torch's math SDPA under a causal mask still computes all s x s products; a causal
        # kernel computes only the entries a query sees (`seen_entries`).
        if window and seq_q:
            full = seq_q * key.shape[-2]
            self.causal[self.current] += flops * (full - seen_entries(seq_q, window)) // full
        needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in (query, key, value))
        if flash and needs_grad and torch.is_grad_enabled() and not self.in_backward:
            kind = "sharded" if self.groups[self.current].tp_split.kind == "block" else "replicated"
            for tensor in (query, key, value, out):
                self.record(tensor, kind)
            # log-sum-exp: one fp32 value per (batch, head, query position)
            self.record(None, kind, key=("lse", id(out)), nbytes=4 * query.numel() // query.shape[-1])
        return out

    def _hf_window(self, key) -> int:
        """The keys a query of a transformers attention module sees at most (0: not causal), where
        the profile passed its ready causal mask and a real device runs a causal kernel
        (`planner.models.hf_attention.profile_mask`): the module's sliding window (its own attribute, else
        its config's) when it cuts the sequence, else the whole sequence."""
        module = next((m for m in reversed(self.stack) if type(m).__module__.startswith("transformers.")
                       and getattr(m, "is_causal", False) is True), None)
        if module is None:
            return 0
        window = (module.sliding_window if hasattr(module, "sliding_window")
                  else getattr(getattr(module, "config", None), "sliding_window", None))
        return min(window, key.shape[-2]) if isinstance(window, int) and window > 0 else key.shape[-2]

    def results(self) -> list[LayerMeasurement]:
        out = []
        for index in range(len(self.groups)):
            by_kind = {"sharded": 0, "replicated": 0, "score": 0, "rebuilt": 0}
            for kind, nbytes in self.saved[index].values():
                by_kind[kind] += nbytes
            out.append(LayerMeasurement(
                fwd_flops=self.fwd[index], bwd_flops=self.bwd[index], causal_saving_flops=self.causal[index],
                act_tp_sharded_bytes=by_kind["sharded"], act_tp_replicated_bytes=by_kind["replicated"],
                act_attn_score_bytes=by_kind["score"], input_bytes=self.inputs[index][0],
                output_bytes=self.outputs[index], input_shapes=self.inputs[index][1],
                called=index in self.order, expert_fwd_flops=self.expert_fwd[index],
                expert_bwd_flops=self.expert_bwd[index], dispatch_bytes=self.dispatch[index],
                expert_act_bytes=sum(self.saved[index][key][1] for key in self.expert_saved[index]),
                conv_fwd_flops=self.conv_fwd[index], conv_bwd_flops=self.conv_bwd[index],
                attn_fwd_flops=self.attn_fwd[index], act_rebuilt_bytes=by_kind["rebuilt"]))
        return out


def seen_entries(seq: int, window: int) -> int:
    """Query-key pairs a causal attention with a sliding window computes: query i (from 0) sees
    min(i + 1, window) keys; window >= seq is plain causal attention, s(s+1)/2 pairs."""
    window = min(window, seq)
    return window * (window + 1) // 2 + (seq - window) * window


def _attention_mode_class():
    from torch.overrides import TorchFunctionMode

    class AttentionMode(TorchFunctionMode):
        """Routes F.scaled_dot_product_attention through the recorder; everything else as is."""

        def __init__(self, recorder: _Recorder):
            super().__init__()
            self.recorder = recorder

        def __torch_function__(self, func, types, args=(), kwargs=None):
            import torch.nn.functional as F

            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                return self.recorder.attention_call(func, args, kwargs)
            return func(*args, **kwargs)

    return AttentionMode


def _AttentionMode(recorder: _Recorder):  # noqa: N802 - reads as the context manager it returns
    return _attention_mode_class()(recorder)
