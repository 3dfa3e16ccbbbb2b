"""Tensor and pipeline parallelism of Hugging Face causal LMs (`hf:config.json`).

Weights: transformers' own initialisation of the whole model on the CPU under the plan's seed,
on every rank (so every layout starts from the single-process weights); each rank then keeps
its pipeline chunks and its tensor-parallel slices.

Tensor parallelism (`apply_layer_tp`): every decoder layer gets DTensor `parallelize_module`
with `ColwiseParallel` on the column Linears and `RowwiseParallel` on the row Linears of its
layout (`planner.models.hf_tp`). A fused projection is split by its known layout: the rows of
Phi-3's [q | k | v] `qkv_proj` and [gate | up] `gate_up_proj` are permuted so that each rank's
contiguous shard holds its own q, k and v heads (or gate and up halves); GPT-NeoX's and Falcon's
`query_key_value` are laid out per head or per K/V group already. The attention module gets
its local head counts (attributes, and a copy of its config, with heads divided by tp). Per-head
norms (Gemma-3's and Qwen3's q/k norms) see only the local heads, so their replicated weights'
gradients are summed over the TP ranks; norms over the whole q or k width (OLMo-2) are split with
the heads (`WidthShardedRMSNorm`); multi-head latent attention's latent projections and their
norms stay whole on every rank. The embedding and the output head stay whole on every
rank (replicated, as the cost model prices them); sequence parallelism is not implemented.
Checkpoints hold the layout's own parameter names (a stage's, below) and the permuted fused
rows: resume them with the same plan.

Pipeline parallelism (`HFStage`): a chunk holds the embedding (first chunk), its decoder layers
and the final norm + output head (last chunk), named `embed.tok`, `blocks.<index>`, `head.norm`
and `head.proj` as the zoo's stages are. It runs through the model's own forward on a skeleton
(a shallow copy of the causal LM whose decoder list holds only this chunk's layers), so the
rotary position embeddings, the masks of every layer type (Gemma's sliding layers), embedding
scaling and logit soft-capping are computed inside each stage from the hidden stream's shape,
exactly as transformers computes them; the hidden stream is the only tensor crossing stages.
A later chunk feeds its input to its first layer (or the final norm), and a chunk that does
not end the model stops after its last layer.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.models.hf_attention import profile_mask


def build_hf_parts(plan, device, seed: int, mesh, dp_mesh):
    """This rank's share of an HF plan with tp > 1 or pp > 1, as `filemodel.ModelParts`
    (`runtime` adds the optimizer, the schedule and the tied-weight exchange)."""
    from meshplan.executor.filemodel import build_seeded

    built = build_seeded(plan, seed)
    if plan.config.pp == 1:
        return _whole_parts(plan, built, device, mesh, dp_mesh)
    return _pipeline_parts(plan, built, device, mesh, dp_mesh)


# ---------------------------------------------------------------------------------- tensor parallel


def apply_layer_tp(layer, tp_mesh, name: str) -> None:
    """Megatron TP of one decoder layer by its layout (module docstring)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    from meshplan.planner.models.hf import expert_modules
    from meshplan.planner.models.hf_tp import tp_layout

    layout = tp_layout(layer, expert_modules(layer))
    tp = tp_mesh.size()
    if isinstance(layout, str) or layout.experts or layout.executor_refusal or not layout.split().max_degree_ok(tp):
        why = layout if isinstance(layout, str) else (
            f"the executor does not split its routed experts ({layout.experts[0]})" if layout.experts
            else layout.executor_refusal or layout.split().divisors_text())
        raise MeshplanError(f"layer {name!r} cannot be split tp={tp} ways: {why}")
    with torch.no_grad():
        if layout.qkv == "blocks":
            q, kv = layout.num_heads * layout.head_dim, layout.num_kv_heads * layout.head_dim
            _permute_rows(layer.get_submodule(layout.fused_qkv), [(0, q), (q, kv), (q + kv, kv)], tp)
        if layout.fused_gate_up:
            _permute_rows(layer.get_submodule(layout.fused_gate_up), [(0, layout.mlp_width),
                                                                       (layout.mlp_width, layout.mlp_width)], tp)
    attention = layer.get_submodule(layout.attention)
    _localise_heads(attention, layout.num_heads, layout.num_kv_heads, tp)
    styles = {n: ColwiseParallel() for n in layout.column_linears}
    styles.update({n: RowwiseParallel() for n in layout.row_linears})
    # Per-head norms (q/k norms) see only this rank's heads: their replicated weights get Partial
    # gradients, summed over the TP ranks before the update (`runtime._align_grad_placements`).
    # Declaring the local heads a shard of dimension 0 is exact: the norms reduce the last one.
    # MLA's latent projections and norms read the replicated hidden state: they stay plain modules,
    # whose gradients arrive whole through the column Linears' input all-reduce.
    prefix = f"{layout.attention}." if layout.attention else ""
    for child, module in attention.named_children():
        path = prefix + child
        if path not in (*styles, *layout.replicated, *layout.width_norms) + layout.width_norms and any(
                True for _ in module.parameters(recurse=False)):
            styles[path] = SequenceParallel(sequence_dim=0, use_local_output=True)
    parallelize_module(layer, tp_mesh, styles)
    if layout.qkv == "mla":
        _sum_shared_key_gradient(attention, tp_mesh)
    for path in layout.width_norms:
        parent, _, child = path.rpartition(".")
        owner = layer.get_submodule(parent) if parent else layer
        setattr(owner, child, WidthShardedRMSNorm(getattr(owner, child), tp_mesh))
    for name in layout.row_linears:
        # the all-reduced output is a view of the DTensor's local tensor, which autograd forbids
        # modifying in place (Falcon adds attention into the MLP's output with +=): a copy
        layer.get_submodule(name).register_forward_hook(lambda module, args, output: output.clone())


class _SumTailGradient(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient of the last `width` features."""

    @staticmethod
    def forward(ctx, x, width: int, group):
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        tail = grad[..., -ctx.width:].contiguous()
        torch.distributed.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.width:] = tail
        return grad, None, None


def _sum_shared_key_gradient(attention: nn.Module, tp_mesh) -> None:
    """Multi-head latent attention's rotary key (the last qk_rope_head_dim outputs of
    `kv_a_proj_with_mqa`) is shared by all heads and reaches them without a column Linear: each
    rank's heads give part of its gradient, summed over the TP ranks here (the latent part's
    gradient is summed by `kv_b_proj`'s column-parallel input)."""
    width, group = attention.qk_rope_head_dim, tp_mesh.get_group()
    attention.kv_a_proj_with_mqa.register_forward_hook(
        lambda module, args, output: _SumTailGradient.apply(output, width, group))


class WidthShardedRMSNorm(nn.Module):
    """An RMSNorm over a width split over the TP ranks (OLMo-2's q/k norms over all heads): each
    rank holds its slice of the weight (a DTensor sharded on dimension 0) and normalises its own
    heads by the mean square over all of them, its partial sum of squares all-reduced (one value
    per token; autograd sums the gradient back the same way)."""

    def __init__(self, norm: nn.Module, tp_mesh):
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        weight = norm.weight.detach()
        self.weight = nn.Parameter(distribute_tensor(weight, tp_mesh, [Shard(0)]))
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self.width = weight.shape[0]
        self.group = tp_mesh.get_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        squares = all_reduce(x.float().pow(2).sum(-1, keepdim=True), group=self.group)
        normed = x.float() * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight.to_local() * normed).to(x.dtype)


def _permute_rows(linear: nn.Linear, blocks: list[tuple[int, int]], tp: int) -> None:
    """Reorder a fused Linear's output rows from [block 0 | block 1 | ...] to, for each rank in
    turn, its 1/tp of every block: the rank's contiguous shard then holds its part of each."""
    order = []
    for rank in range(tp):
        for start, size in blocks:
            part = size // tp
            order.extend(range(start + rank * part, start + (rank + 1) * part))
    index = torch.tensor(order, device=linear.weight.device)
    linear.weight.copy_(linear.weight[index].clone())
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[index].clone())


def _localise_heads(attention: nn.Module, heads: int, kv_heads: int, tp: int) -> None:
    """Head counts the attention's reshapes read, divided by tp: its own attributes and a
    private copy of its config (Phi-3 reads `config.num_attention_heads`)."""
    from meshplan.planner.models.hf_tp import HEAD_ATTRIBUTES, KV_HEAD_ATTRIBUTES

    def localise(obj):
        for attr in HEAD_ATTRIBUTES + KV_HEAD_ATTRIBUTES:
            value = getattr(obj, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value in (heads, kv_heads):
                setattr(obj, attr, value // tp)

    localise(attention)
    if getattr(attention, "config", None) is not None:
        attention.config = copy.copy(attention.config)
        localise(attention.config)


def _whole_parts(plan, built, device, mesh, dp_mesh):
    """pp = 1: the whole model on every rank, its decoder layers tensor-parallel."""
    from meshplan.executor.filemodel import ModelParts, apply_file_recompute, training_fns
    from meshplan.planner.costing.state_memory import dp_method
    from meshplan.planner.models.hf import model_parts

    cfg = plan.config
    module = built.module.to(device)
    layers = getattr(module.base_model, model_parts(module, plan.model.spec)["layers"])
    for index, layer in enumerate(layers):
        apply_layer_tp(layer, mesh["tp"], f"blocks.{index}")
    apply_file_recompute(plan, built)
    method = dp_method(cfg.zero, cfg.dp, cfg.tp, cfg.pp, cfg.precision)
    wrapped = _whole_dp(module, built, dp_mesh, cfg, method)
    forward_fn, loss_fn = training_fns(built)
    return ModelParts((0,), (module,), (wrapped,), method, loss_fn, forward_fn)


def _whole_dp(module, built, dp_mesh, cfg, method: str):
    """FSDP2 `replicate` (ZeRO-0) or `fully_shard` (ZeRO 1-3) per layer, then on the model, with
    FSDP's mixed-precision policy under bf16-mixed (as for DP-only HF plans)."""
    from meshplan.executor.filemodel import apply_file_dp
    from meshplan.executor.parallel.data import mixed_precision

    return apply_file_dp(module, built, dp_mesh, cfg.zero, method, mixed_precision(cfg.precision))


# -------------------------------------------------------------------------------- pipeline stages


class _StageDone(Exception):
    """Raised after a chunk's last decoder layer: carries the hidden stream to the next stage."""

    def __init__(self, hidden):
        super().__init__("pipeline chunk done")
        self.hidden = hidden


class _Stop(nn.Module):
    """The entry after a chunk's last layer in its skeleton's decoder list."""

    def forward(self, hidden_states, *args, **kwargs):
        raise _StageDone(hidden_states)


class _Holder(nn.Module):
    """Names a chunk's embedding `embed.tok` and its head `head.norm`, `head.proj`."""

    def __init__(self, **modules):
        super().__init__()
        for name, module in modules.items():
            if module is not None:
                self.add_module(name, module)


class HFStage(nn.Module):
    """One pipeline chunk of a Hugging Face causal LM (module docstring)."""

    def __init__(self, model: nn.Module, layer_names: list[str], spec: str, last: bool):
        super().__init__()
        from meshplan.planner.models.hf import model_parts

        parts = model_parts(model, spec)
        base = model.base_model
        layer_list = getattr(base, parts["layers"])
        indices = [int(name.split(".", 1)[1]) for name in layer_names if name.startswith("blocks.")]
        norm = getattr(base, parts["norm"]) if parts["norm"] else None
        self.embed = _Holder(tok=model.get_input_embeddings()) if "embed" in layer_names else None
        self.blocks = nn.ModuleDict({str(i): layer_list[i] for i in indices})
        self.head = _Holder(norm=norm, proj=model.get_output_embeddings()) if "head" in layer_names else None
        skip = {parts["layers"], parts["embed"], parts["norm"]}
        # rotary embeddings and the like: no parameters (checked before training), moved with the stage
        self.glue = nn.ModuleDict({n: m for n, m in base.named_children() if n not in skip})
        self.layer_names = list(layer_names)
        self.tied_embeddings = False
        self._incoming = None  # a later chunk's input while its forward runs
        self._skeleton = (_skeleton(model, parts, layer_list, indices, last),)  # not a submodule
        target = layer_list[indices[0]] if indices else norm
        if self.embed is None:
            target.register_forward_pre_hook(self._inject, with_kwargs=True)

    def _inject(self, module, args, kwargs):
        """Replace the skeleton's hidden stream with this chunk's input (same dtype: an FSDP
        policy may have cast the stream)."""
        if self._incoming is None:
            return None
        if args:
            return (self._incoming.to(args[0].dtype),) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._incoming.to(kwargs["hidden_states"].dtype)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = profile_mask(x.shape[1], x.device)  # none on a real device: transformers builds each layer's
        inputs = {"input_ids": x} if self.embed is not None else {"inputs_embeds": x.detach()}
        self._incoming = None if self.embed is not None else x
        try:
            return self._skeleton[0](**inputs, attention_mask=mask, use_cache=False).logits
        except _StageDone as done:
            return done.hidden
        finally:
            self._incoming = None

    def layer(self, name: str) -> tuple:
        """The modules of one of the chunk's layers (the head: its norm and output Linear)."""
        if name == "embed":
            return (self.embed.tok,)
        if name == "head":
            return tuple(self.head.children())
        return (self.blocks[name.split(".", 1)[1]],)


def _skeleton(model, parts: dict, layer_list, indices: list[int], last: bool):
    """A shallow copy of the causal LM whose decoder list holds the layers at `indices` (then a
    stop unless the chunk ends the model) and whose config lists those layers' types in order
    (the model's loop reads `layer_types` by position)."""
    base = copy.copy(model.base_model)
    base._modules = dict(base._modules)
    stops = [] if last else [_Stop()]
    base._modules[parts["layers"]] = nn.ModuleList([layer_list[i] for i in indices] + stops)
    config = copy.copy(base.config)
    config.num_hidden_layers = len(indices) + len(stops)
    types = getattr(config, "layer_types", None)
    if isinstance(types, list):
        config.layer_types = [types[i] for i in indices] + types[-1:] * len(stops)
    base.config = config
    lm = copy.copy(model)
    lm._modules = dict(lm._modules)
    lm._modules[parts["base"]] = base
    return lm


def _pipeline_parts(plan, built, device, mesh, dp_mesh):
    """pp > 1: this rank's chunks as `HFStage`s (TP inside each), recompute, DP per chunk."""
    from meshplan.executor.filemodel import ModelParts
    from meshplan.executor.parallel.data import apply_dp, mixed_precision
    from meshplan.executor.parallel.recompute import apply_recompute
    from meshplan.planner.contracts.engine_rules import early_stop_of
    from meshplan.planner.costing.state_memory import dp_method
    from meshplan.planner.models.transformer import lm_loss

    cfg, model = plan.config, built.module
    chunk_ids = cfg.chunks_of_rank(mesh.get_local_rank("pp"))
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if tied:  # the head's copy of the tied weight: its own parameter, gradients summed after the backward
        head = model.get_output_embeddings()
        head.weight = nn.Parameter(head.weight.detach().clone())
    names, chunks, last = [layer.name for layer in plan.layers], plan.chunks(), cfg.num_model_chunks - 1
    stages = [HFStage(model, [names[i] for i in chunks[c]], plan.model.spec, c == last) for c in chunk_ids]
    del built, model  # layers of other chunks go with them
    recompute = {layer.name: layer.recompute for layer in plan.layers}
    for stage in stages:
        stage.to(device)
        for index, block in stage.blocks.items():
            if cfg.tp > 1:
                apply_layer_tp(block, mesh["tp"], f"blocks.{index}")
        for name in stage.layer_names:
            if name != "embed":
                for module in stage.layer(name):
                    apply_recompute(module, recompute[name], early_stop_of(cfg))
    method = dp_method(cfg.zero, cfg.data_ranks, cfg.tp, cfg.pp, cfg.precision)
    mp_policy = mixed_precision(cfg.precision)
    modules = tuple(apply_dp(stage, dp_mesh, cfg.zero, method, mp_policy) for stage in stages)

    def loss_fn(logits, micro):  # micro: (targets,) as the pipeline schedule passes them
        return lm_loss(logits, micro[0])

    return ModelParts(tuple(chunk_ids), tuple(stages), modules, method, loss_fn, tied=tied)

