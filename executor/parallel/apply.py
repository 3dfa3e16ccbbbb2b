"""Turn a meta-device model into this rank's share of a plan: one `apply_*` per technique.

Order (torchtitan's): split into pipeline chunks -> tensor parallelism -> materialise and
initialise -> activation checkpointing -> data parallelism. TP comes first because FSDP and
`replicate` compose on top of TP's DTensors, not the other way round; weights are written while
they are still only TP-sharded (a 1-D slice of the full tensor computed locally), and FSDP then
shards the real tensors, so no strided-shard arithmetic is needed; checkpointing wraps a block's
forward before FSDP registers its hooks, so FSDP gathers parameters outside the recomputed region.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from meshplan.planner.contracts.errors import MeshplanError


class StageModule(nn.Module):
    """One pipeline chunk: contiguous layers of a `CausalLM`, keeping their full-model names.

    Blocks sit in a ModuleDict keyed by their index in the full model, so parameter names (and
    therefore checkpoints) are the same whatever the pipeline split.
    """

    def __init__(self, model: nn.Module, layer_names: list[str]):
        super().__init__()
        self.embed = model.embed if "embed" in layer_names else None
        indices = [name.split(".", 1)[1] for name in layer_names if name.startswith("blocks.")]
        self.blocks = nn.ModuleDict({index: model.blocks[int(index)] for index in indices})
        self.head = model.head if "head" in layer_names else None
        self.layer_names = list(layer_names)
        self.tied_embeddings = bool(getattr(model.cfg, "tied_embeddings", False))
        self.autocast_dtype: torch.dtype | None = None  # set when autocast (not FSDP) does mixed precision

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is None:
            return self._layers(h)
        with torch.autocast(device_type=h.device.type, dtype=self.autocast_dtype):
            return self._layers(h)

    def _layers(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for block in self.blocks.values():
            h = block(h)
        if self.head is not None:
            h = self.head(h)
        return h

    def layer(self, name: str) -> nn.Module:
        if name == "embed":
            return self.embed
        if name == "head":
            return self.head
        return self.blocks[name.split(".", 1)[1]]


def split_stages(model: nn.Module, layer_names: list[str], chunks: list[list[int]],
                 chunk_ids: list[int]) -> list[StageModule]:
    """The StageModules of the chunks this pipeline rank runs (`chunk_ids`, in order)."""
    return [StageModule(model, [layer_names[i] for i in chunks[c]]) for c in chunk_ids]


def apply_tp(stage: StageModule, tp_mesh, sp: bool) -> None:
    """Megatron-LM TP: column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel
    embedding (row-wise: each rank holds 1/tp of the vocabulary rows, outputs are summed) and
    head (column-wise over the vocabulary) with a vocab-parallel loss: logits are never gathered.

    With sequence parallelism the residual stream between blocks is sharded along the sequence,
    norms run as `SequenceParallel`, and the embedding output / head input are converted at the
    edges. A tied embedding stays tied: both weights are (vocab, hidden) sharded on dim 0.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    row_output = Shard(1) if sp else Replicate()
    for block in stage.blocks.values():
        block_plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                      "attn.o": RowwiseParallel(output_layouts=row_output),
                      "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=row_output)}
        if getattr(block.mlp, "swiglu", False):
            block_plan["mlp.gate"] = ColwiseParallel()
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            block_plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                               "attn": gather, "mlp": gather})
        parallelize_module(block, tp_mesh, block_plan)
    if stage.embed is not None:
        # GPT adds learned positions after the token lookup, so the lookup's output is replicated
        # and the sequence split (SP) happens at the embedding's output.
        parallelize_module(stage.embed, tp_mesh, {"tok": RowwiseParallel(input_layouts=Replicate(),
                                                                          output_layouts=Replicate())})
        if sp:
            parallelize_module(stage.embed, tp_mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)))
    if stage.head is not None:
        # Logits stay sharded over the vocabulary (a DTensor); the loss runs under `loss_parallel`.
        head_plan = {"proj": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        if sp:
            head_plan["norm"] = SequenceParallel()
            head_plan["proj"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                use_local_output=False)
        parallelize_module(stage.head, tp_mesh, head_plan)
    if stage.embed is not None and stage.head is not None and stage.tied_embeddings:
        stage.head.proj.weight = stage.embed.tok.weight  # distributing the weights untied them


@torch.no_grad()
def materialize(stages: list[StageModule], template: nn.Module, seed: int, device: torch.device,
                tied_embeddings: bool) -> None:
    """`to_empty` then write `init_weights(template, seed)` values, each rank keeping its slices.

    `template` is the full model on the meta device; its values are drawn one parameter at a
    time in the single-process order, so every layout starts from the single-process weights.
    """
    from meshplan.planner.models.transformer import iter_init_values

    local = {}
    for stage in stages:
        stage.to_empty(device=device)
        if tied_embeddings and stage.embed is not None and stage.head is not None:
            stage.head.proj.weight = stage.embed.tok.weight  # to_empty from meta unties shared parameters
        local.update(dict(stage.named_parameters(remove_duplicate=True)))
    written = set()
    for name, _, values in iter_init_values(template, seed):
        # A tied embedding split across pipeline stages lives on the last stage as head.proj.weight.
        targets = [name, "head.proj.weight"] if tied_embeddings and name == "embed.tok.weight" else [name]
        for target in targets:
            if target in local:
                _copy_full_into(local[target], values)
                written.add(target)
    missing = sorted(set(local) - written)
    assert not missing, f"parameters without an initial value: {missing[:5]}"
    for stage in stages:  # buffers (none in the zoo today) start at zero rather than garbage
        for buffer in stage.buffers():
            buffer.zero_()


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
        rows = tuple(slice(start, start + size) for start, size in zip(offset, shape))
        param.to_local().copy_(full[rows].to(param.dtype))
    else:
        param.copy_(full.to(param.dtype))


def _attention_core_policy(ctx, op, *args, **kwargs):
    """Selective recomputation (Megatron-LM): recompute only the attention core, keep the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _attention_ops():
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _attention_ops() -> set:
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_attention_math")
    return {getattr(aten, name).default for name in names if hasattr(aten, name)}


def apply_recompute(module: nn.Module, mode: str) -> None:
    """Activation checkpointing of one layer: "full" recomputes its whole forward in backward,
    "selective" only the attention core. The forward is replaced on the instance (no wrapper
    module), so parameter names and checkpoints do not change."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise MeshplanError(f"unknown recompute mode {mode!r}; use none, selective or full")
    original = module.forward
    context_fn = (partial(create_selective_checkpoint_contexts, _attention_core_policy)
                  if mode == "selective" else None)

    def checkpointed_forward(*args, **kwargs):
        if context_fn is None:
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
        return checkpoint(original, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = checkpointed_forward


def dp_method(zero: int, dp: int, tp: int, pp: int) -> str:
    """Which data-parallel wrapper a (zero, mesh) uses: "none", "ddp", "replicate" or "fsdp".

    DDP only on plain data parallelism: under DTensor TP it fails (mixed Tensor/DTensor cat) and
    under PP it only works with 1F1B, so ZeRO-0 there is FSDP2-based `replicate`.
    """
    if dp == 1:
        return "none"
    if zero == 0:
        return "ddp" if tp == 1 and pp == 1 else "replicate"
    return "fsdp"


def apply_dp(stage: StageModule, dp_mesh, zero: int, method: str, mp_policy=None) -> nn.Module:
    """Data parallelism of one chunk per ZeRO stage; returns the module to run.

    ZeRO-1: `fully_shard(reshard_after_forward=False)` with gradients reduce-scattered once, after
    the last micro-batch (full parameters and gradients during the step, optimizer state sharded);
    ZeRO-2: the same with a reduce-scatter per micro-batch (gradients sharded);
    ZeRO-3: `fully_shard(reshard_after_forward=True)` (parameters sharded between uses too).
    """
    if method == "none":
        return stage
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(stage, process_group=dp_mesh.get_group())
    kwargs = {"mesh": dp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if method == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in stage.blocks.values():
            replicate(block, **kwargs)
        replicate(stage, **kwargs)
        return stage
    from torch.distributed.fsdp import fully_shard

    for block in stage.blocks.values():
        fully_shard(block, reshard_after_forward=zero == 3, **kwargs)
    fully_shard(stage, reshard_after_forward=zero == 3, **kwargs)
    return stage
