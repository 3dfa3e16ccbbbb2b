"""Tensor (and sequence) parallelism: the Megatron-LM layout of `planner.models.tensor_parallel`
applied with DTensor `parallelize_module`."""
from __future__ import annotations

from meshplan.executor.parallel.stages import StageModule
from meshplan.planner.models.tensor_parallel import block_tp_plan


def apply_tp(stage: StageModule, tp_mesh, sp: bool, recompute: dict[str, str] | None = None) -> None:
    """Megatron-LM TP: column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel
    embedding (row-wise: each rank holds 1/tp of the vocabulary rows, outputs are summed) and
    head (column-wise over the vocabulary) with a vocab-parallel loss: logits are never gathered.

    With sequence parallelism the residual stream between blocks is sharded along the sequence,
    norms run as `SequenceParallel`, and the embedding output / head input are converted at the
    edges. A tied embedding stays tied: both weights are (vocab, hidden) sharded on dim 0.
    Blocks without full recomputation (`recompute`: layer name -> mode; selective checkpoints only
    the attention core) keep only the sequence shard of each region's input for backward and
    gather it again there, as Megatron-LM does.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, SequenceParallel,
                                                   parallelize_module)

    recompute = recompute or {}
    for name, block in stage.blocks.items():
        keep_shard = recompute.get(f"blocks.{name}", "none") != "full"
        parallelize_module(block, tp_mesh, block_tp_plan(block, sp, keep_shard=keep_shard))
    if stage.embed is not None:
        # GPT adds learned positions after the token lookup, so the lookup's output is replicated
        # and the sequence split (SP) happens at the embedding's output.
        vocab_parallel_lookup(stage.embed.tok, tp_mesh)
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


def vocab_parallel_lookup(lookup, tp_mesh) -> None:
    """Megatron-LM's vocab-parallel embedding: the `nn.Embedding`'s weight sharded by rows (a
    DTensor, as torch's `RowwiseParallel` shards it), each rank looking up the tokens of its own rows on
    its local shard (the others masked to zero), the outputs summed over the TP group into a
    replicated (local) tensor. DTensor's own lookup would give the weight a Replicate gradient of
    the whole (vocab, hidden) table, accumulated over the micro-batches until the step's end
    (7.8 GiB in fp32 at Llama 3 405B); here the gradient is born sharded, 1/t of it."""
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    lookup.weight = nn.Parameter(distribute_tensor(lookup.weight, tp_mesh, [Shard(0)]))

    def forward(tokens):
        rows = lookup.weight.to_local(grad_placements=(Shard(0),))
        first = tp_mesh.get_local_rank() * rows.shape[0]
        outside = (tokens < first) | (tokens >= first + rows.shape[0])
        local = F.embedding((tokens - first).masked_fill(outside, 0), rows).masked_fill(outside.unsqueeze(-1), 0.0)
        summed = DTensor.from_local(local, tp_mesh, (Partial(),), run_check=False)
        return summed.redistribute(tp_mesh, (Replicate(),)).to_local()

    lookup.forward = forward
