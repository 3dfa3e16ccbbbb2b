"""gpu_check's loss_memory section: torchtitan's loss on one GPU, measured beside meshplan's rule.

The output layer's bf16 logits, then `cross_entropy(pred.float(), labels)`, `del pred` and the
backward, as torchtitan's training step runs them, in three modes:
- "eager": plain cross-entropy;
- "loss_parallel": under torch's `loss_parallel` on a one-rank mesh, which runs its fused backward
  (`_nll_loss_and_log_softmax_backward`) as it does on a TP group;
- "compiled": the loss under torch.compile (torchtitan 0.2's `[compile] components` default).

Each mode's peak allocated bytes beyond what was live before (`torch.cuda.max_memory_allocated`),
in fp32 copies of the logits, beside meshplan's head rule (`loss_kernels.torch_ce_held_bytes_per_logit`:
eager, the saved log-probs and the fp32 copies its backward holds; compiled, the saved bf16 logits
and their bf16 gradient, half a copy each), and what the caching allocator reserved beyond what it
allocated: a lead not priced is that the freed bf16 logits' block cannot hold the fp32 copies the
backward asks for next, so an eager loss reserves half a copy more than it allocates.

The output layer's weight takes no gradient here and its input's gradient is counted apart, so
the figures are the loss's alone. Given a timer (CUDA events), each mode's loss forward and
backward on the logits is also timed beside meshplan's seconds for it: the bytes a logit its
kernels move (`loss_kernels.TORCH_CE_BYTES_PER_LOGIT`) at each profile's achieved bandwidth. On a
device without memory statistics (the CPU) the measured fields are None: a dry run of the code path.
"""
from __future__ import annotations

import os
import tempfile

# Llama 3 8B's output layer at torchtitan's local batch 2 of 8,192 tokens (llama3_8b.toml)
TOKENS, HIDDEN, VOCAB = 2 * 8192, 4096, 128256
MODES = ("eager", "loss_parallel", "compiled")


def predicted_copies(mode: str) -> float:
    """meshplan's peak of the loss in fp32 copies of the bf16 logits (`loss_kernels.torch_ce_held_bytes_per_logit`,
    what it keeps and what its backward holds beside it; the modes are its kinds)."""
    from meshplan.planner.costing.loss_kernels import torch_ce_held_bytes_per_logit

    kept, working = torch_ce_held_bytes_per_logit(mode, compute_bytes=2.0)
    return (kept + working) / 4.0


def _mesh(torch, device: str):
    """A one-rank device mesh (a process group of one, nccl on CUDA, gloo elsewhere)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="loss-memory-"), "store"), 1)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    return init_device_mesh(device, (1,))


def run_loss(torch, device: str, mode: str, tokens: int, hidden: int, vocab: int) -> dict:
    """One step of the output layer and loss in `mode`: peak allocated and reserved bytes beyond
    the start, in fp32 copies of the logits (None without memory statistics)."""
    import contextlib

    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    def ce(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    loss_fn = torch.compile(ce) if mode == "compiled" else ce
    x = torch.randn(2, tokens // 2, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16) / hidden ** 0.5
    labels = torch.randint(0, vocab, (2, tokens // 2), device=device)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    pred = x @ weight.t()
    if mode == "loss_parallel":
        pred = DTensor.from_local(pred, _mesh(torch, device), [Shard(2)])
    with loss_parallel() if mode == "loss_parallel" else contextlib.nullcontext():
        loss = loss_fn(pred, labels)
        del pred
        loss.backward()
    unit = 4.0 * tokens * vocab
    out = {"mode": mode, "tokens": tokens, "vocab": vocab, "predicted_copies": predicted_copies(mode),
           "measured_allocated_copies": None, "measured_reserved_copies": None}
    if cuda:
        torch.cuda.synchronize()
        grad_bytes = x.numel() * x.element_size()  # the output layer's input gradient, not the loss's
        out["measured_allocated_copies"] = (torch.cuda.max_memory_allocated() - allocated - grad_bytes) / unit
        out["measured_reserved_copies"] = (torch.cuda.max_memory_reserved() - reserved) / unit
    return out


def predicted_s(mode: str, tokens: int, vocab: int, cluster) -> float:
    """meshplan's seconds for the loss's forward and backward kernels on `tokens` x `vocab` bf16
    logits in `mode` (`loss_kernels.TORCH_CE_BYTES_PER_LOGIT` at the profile's achieved bandwidth)."""
    from meshplan.planner.costing.device_time import memory_time_s
    from meshplan.planner.costing.loss_kernels import TORCH_CE_BYTES_PER_LOGIT

    return sum(memory_time_s(passes * tokens * vocab, cluster) for passes in TORCH_CE_BYTES_PER_LOGIT[mode])


def time_loss(torch, device: str, mode: str, tokens: int, vocab: int, timer) -> float:
    """Seconds of the loss's forward and backward on bf16 logits (a leaf, its gradient dropped each
    call so nothing accumulates), as `timer(fn)` measures `fn`."""
    import contextlib

    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    def ce(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    loss_fn = torch.compile(ce) if mode == "compiled" else ce
    local = torch.randn(2, tokens // 2, vocab, device=device, dtype=torch.bfloat16)
    pred = (DTensor.from_local(local, _mesh(torch, device), [Shard(2)]) if mode == "loss_parallel" else local)
    pred.requires_grad_(True)
    labels = torch.randint(0, vocab, (2, tokens // 2), device=device)

    def step():
        pred.grad = None
        with loss_parallel() if mode == "loss_parallel" else contextlib.nullcontext():
            loss_fn(pred, labels).backward()

    return timer(step)


def check_loss_memory(torch, clusters: dict | None = None, device: str = "cuda", tokens: int = TOKENS,
                      hidden: int = HIDDEN, vocab: int = VOCAB, modes=MODES, timer=None) -> dict:
    """Every mode's row (`run_loss`) with its measured over predicted copies where measured, and with
    a `timer`, its seconds beside each profile's (`predicted_s`)."""
    rows = []
    for mode in modes:
        row = run_loss(torch, device, mode, tokens, hidden, vocab)
        row["measured_s"] = time_loss(torch, device, mode, tokens, vocab, timer) if timer else None
        for name, cluster in (clusters or {}).items():
            row[f"predicted_s[{name}]"] = predicted_s(mode, tokens, vocab, cluster)
        if row["measured_allocated_copies"] is not None:
            row["allocated_over_predicted"] = row["measured_allocated_copies"] / row["predicted_copies"]
            row["reserved_beyond_allocated_copies"] = (row["measured_reserved_copies"]
                                                       - row["measured_allocated_copies"])
        rows.append(row)
    return {"rows": rows}
