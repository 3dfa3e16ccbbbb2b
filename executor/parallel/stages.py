"""Pipeline parallelism: cut a model into chunks (`StageModule`) and materialise their weights
from the single-process initialisation, each rank keeping only its slices."""
from __future__ import annotations

import torch
from torch import nn


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

    def forward(self, h: torch.Tensor) -> torch.Tensor:
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
