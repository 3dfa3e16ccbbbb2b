"""Training a `path/model.py:fn` or `hf:config.json` model: the whole module on every rank, data
parallelism only (HF plans with tp > 1 or pp > 1: `executor.parallel.hf`).

The module is built on the CPU under `torch.manual_seed(seed)` (every rank the same weights as a
single process with that seed), recomputation is applied per planned layer (a top-level child),
then DDP (ZeRO-0) or `fully_shard` per layer and on the whole module (ZeRO-1/2/3).

File-model batches are synthetic, shaped like the example inputs with the batch dimension
replaced: floats ~ N(0, 1), integers uniform in [0, max(example) + 1) (at least [0, 2)), all
drawn from one generator per (seed, step) for the whole global batch, so the data never depends
on the layout. Hugging Face causal LMs train on token batches like the zoo's (`executor.data`:
synthetic, or a text file's bytes) with the next-token loss; their weights are transformers'
own initialisation from its config under the seed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.planner.contracts.errors import MeshplanError


@dataclass(frozen=True)
class InputSpec:
    """One positional input: per-sample shape, dtype, and the upper bound of integer values."""

    shape: tuple[int, ...]  # without the batch dimension
    dtype: object  # torch.dtype
    high: int  # integers are drawn in [0, high); unused for floats

    def __post_init__(self):
        if self.high < 1:
            raise ValueError(f"integer inputs need an upper bound >= 1, got {self.high}")


@dataclass(frozen=True)
class FileDataSource:
    """Synthetic batches for a file model, deterministic from (seed, step)."""

    inputs: tuple[InputSpec, ...]
    seed: int


@dataclass(frozen=True)
class ModelParts:
    """What a file or HF model contributes to a rank's `runtime.Runtime`."""

    chunk_ids: tuple[int, ...]
    stages: tuple  # the modules holding the parameters (the model, or its pipeline chunks)
    modules: tuple  # what runs: the same, wrapped for data parallelism
    dp_method: str
    loss_fn: Any  # loss_fn(output, micro)
    forward_fn: Any = None  # forward_fn(module, micro); None under a pipeline schedule
    tied: bool = False  # a tied embedding split across pipeline chunks


def file_parts(plan, device, seed: int, dp_mesh) -> ModelParts:
    """The whole model on every rank (pp = tp = 1): seeded CPU weights, recompute, DP."""
    from meshplan.executor.parallel.data import mixed_precision
    from meshplan.planner.costing.state_memory import dp_method

    cfg = plan.config
    built = build_seeded(plan, seed)
    module = built.module.to(device)
    apply_file_recompute(plan, built)
    method = dp_method(cfg.zero, cfg.dp, cfg.tp, cfg.pp, cfg.precision)
    wrapped = apply_file_dp(module, built, dp_mesh, cfg.zero, method, mixed_precision(cfg.precision))
    forward_fn, loss_fn = training_fns(built)
    return ModelParts((0,), (module,), (wrapped,), method, loss_fn, forward_fn)


def data_source(built, seed: int) -> FileDataSource:
    """Input specs from the example inputs (built on the CPU: integer bounds come from values)."""
    specs = []
    for x in built.example_inputs:
        high = 1
        if not x.is_floating_point() and x.numel():
            high = int(x.max()) + 1
        specs.append(InputSpec(tuple(x.shape[1:]), x.dtype, max(2, high)))
    return FileDataSource(tuple(specs), seed)


def global_batch(source: FileDataSource, step: int, num_samples: int) -> tuple:
    """The step's whole batch: one tensor per input, batch dimension `num_samples`."""
    import torch

    generator = torch.Generator().manual_seed(source.seed * 1_000_003 + step)
    out = []
    for spec in source.inputs:
        shape = (num_samples, *spec.shape)
        if spec.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=generator, dtype=torch.float32).to(spec.dtype))
        elif spec.dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=generator).bool())
        else:
            out.append(torch.randint(0, spec.high, shape, generator=generator, dtype=torch.int64).to(spec.dtype))
    return tuple(out)


def replica_slice(batch: tuple, dp_rank: int, dp: int) -> tuple:
    """The contiguous block of samples data-parallel replica `dp_rank` trains on."""
    per_replica = batch[0].shape[0] // dp
    return tuple(x[dp_rank * per_replica:(dp_rank + 1) * per_replica] for x in batch)


def build_seeded(plan, seed: int):
    """The file model's BuiltModel on the CPU, its weights those `torch.manual_seed(seed)` gives."""
    import torch

    from meshplan.planner.models.registry import build_model

    torch.manual_seed(seed)
    return build_model(plan.model.spec, plan.model.seq, device="cpu")


def is_hf(built) -> bool:
    return built.info.family == "hf"


def training_fns(built):
    """(forward(module, micro), loss(output, micro)) for one micro-batch tuple: a file model's
    own inputs and `loss_fn`; for a Hugging Face model (tokens, next-token targets)."""
    if not is_hf(built):
        return (lambda module, micro: module(*micro)), built.loss_fn
    from meshplan.planner.models.transformer import lm_loss

    return (lambda module, micro: built.forward_fn(module, micro[:1])), (lambda logits, micro: lm_loss(logits, micro[1]))


def _layer_parts(built) -> dict:
    """Layer name -> the modules it is made of (a Hugging Face head is its norm and its output
    Linear, which the model calls one by one)."""
    if built.layer_groups:
        return {group.name: group.modules for group in built.layer_groups}
    return {name: (module,) for name, _, module in built.layer_modules}


def apply_file_recompute(plan, built) -> None:
    """Checkpoint each planned layer that asks for it; layers are the module's top-level children
    (Hugging Face: the embedding, each decoder layer, the head's modules)."""
    from meshplan.executor.parallel.recompute import apply_recompute
    from meshplan.planner.contracts.engine_rules import early_stop_of

    layers = _layer_parts(built)
    for layer in plan.layers:
        if layer.recompute == "none":
            continue
        if layer.name not in layers:
            raise MeshplanError(f"layer {layer.name!r} of the plan is not a top-level child of {plan.model.spec!r}; "
                                "re-plan it with --recompute none")
        for module in layers[layer.name]:
            apply_recompute(module, layer.recompute, early_stop_of(plan.config))


def apply_file_dp(module, built, dp_mesh, zero: int, method: str, mp_policy=None):
    """Per `state_memory.dp_method`: DDP (fp32 ZeRO-0), or FSDP2 `replicate` (bf16-mixed ZeRO-0)
    or `fully_shard` (ZeRO-1/2/3) per layer (`_fsdp_units`), then on the whole module."""
    if method == "none":
        return module
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=dp_mesh.get_group())
    kwargs = {"mesh": dp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
        _cast_norm_statistics(module, mp_policy.param_dtype)
    if method == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate as wrap
    else:
        from torch.distributed.fsdp import fully_shard as wrap

        kwargs["reshard_after_forward"] = zero == 3
    for unit in _fsdp_units(built, module):
        wrap(unit, **kwargs)
    wrap(module, **kwargs)
    return module


def _cast_norm_statistics(module, dtype) -> None:
    """Batch norms' running statistics in the compute dtype: FSDP2's policy casts parameters, not
    buffers, and CPU kernels refuse mixed dtypes. Training normalises by each batch's own
    statistics, so only evaluation reads the rounded running ones."""
    from torch.nn.modules.batchnorm import _BatchNorm

    for sub in module.modules():
        if isinstance(sub, _BatchNorm):
            for name, buffer in sub.named_buffers(recurse=False):
                if buffer is not None and buffer.is_floating_point():
                    setattr(sub, name, buffer.to(dtype))


def _fsdp_units(built, root) -> list:
    """The modules of every layer that own parameters no other layer uses: each its own FSDP
    unit. A weight two layers share (a tied embedding and head) cannot live in two units, so
    those layers stay with the root."""
    parts = [m for modules in _layer_parts(built).values() for m in modules if m is not root]
    users: dict[int, int] = {}
    for part in parts:
        for param in part.parameters():
            users[id(param)] = users.get(id(param), 0) + 1
    return [part for part in parts if any(True for _ in part.parameters())
            and all(users[id(param)] == 1 for param in part.parameters())]
