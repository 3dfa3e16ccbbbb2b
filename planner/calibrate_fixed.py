"""`calibrate`'s measurements of the fixed costs `planner.fixed_costs` charges, and their fits.

Run inside every calibration worker, all ranks at once (as in training):

- the share of a core each process gets while all of them compute (`cpu_share`): on a host
  with fewer cores than processes (4 processes on 2 cores) every process runs at that share,
  which CPU-time measurements do not see; the profile's compute rates are scaled by it;
- the optimizer update as the executor runs it (`executor.runtime`: AdamW with its
  hyperparameters, foreach left to torch for plain tensors and off for DTensors, after a
  global-norm clip that touches every gradient) on parameter sets of many small and a few
  large tensors, plain and DTensor: fitted to t = tensors x per_tensor_s + params x per_param_s;
- a small partial DTensor redistributed to a replicated one (what the executor does to each TP
  norm gradient per step);
- a tiny transformer block, forward + backward, plain, tensor-parallel over all ranks (the
  executor's Megatron plan through `parallelize_module`) and FSDP-wrapped over all ranks: what
  the plain block and the collectives' alpha-beta cost do not explain is the per-pass overhead
  of TP and of the data-parallel wrapper;
- a pipeline of one tiny Linear per rank under torch's 1F1B schedule: its step time over the
  number of actions on the critical path is the per-action overhead.
"""
from __future__ import annotations

import time

from planner.comm import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s, send_recv_time_s

# The executor's AdamW and clipping settings (executor.runtime.Hyperparameters defaults).
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# (number of tensors, elements each): per-tensor dominated, mixed, and bandwidth dominated, at the
# sizes of small models' biases, norms and Linears.
OPTIMIZER_SETS = ((64, 1024), (16, 2**16), (4, 2**18))
# A small model whose update the per-parameter cost is taken from (see _time_model_update).
OPTIMIZER_MODEL, OPTIMIZER_MODEL_SEQ = "gpt:layers=2,hidden=256,heads=4,vocab=4096", 64
TINY_BLOCK = {"hidden_per_head": 16, "ffn_factor": 4, "seq": 8}
# Repetitions of the wall-clock fixed-cost timings (tiny, so cheap): their minimum is the least
# disturbed by other processes.
MIN_WALL_REPS = 8
# 256 x 256 matmuls in one burst of measure_cpu_share: ~0.2 s of one core.
BURST_MATMULS = 400
PIPELINE_MICROBATCHES_PER_STAGE = 4


def wall_min_s(dist, fn, reps: int) -> float:
    """Fastest of `reps` wall-clock runs of a collective `fn`, every rank starting together."""
    for _ in range(2):  # warm-up: allocations, connections, DTensor sharding caches
        fn()
    best = float("inf")
    for _ in range(max(reps, MIN_WALL_REPS)):
        dist.barrier()
        begin = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - begin)
    return best


def measure_cpu_share(torch, dist, reps: int = 3) -> float:
    """The share of a core each process gets while all compute at once.

    Measured as the ratio of CPU time to wall time of a ~0.2 s matmul burst run by all ranks
    together (several scheduler time slices, so no rank can finish before the others start),
    the best of `reps` per rank, averaged over the ranks (a rank scheduled first sees more than
    its share, the last one less); but never below cores / (processes x threads): other jobs on
    a shared machine lower the measurement for a while, and the profile should describe the
    machine, not them.
    """
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    expected = min(1.0, cores / (dist.get_world_size() * torch.get_num_threads()))
    a = torch.randn(256, 256)
    best = 0.0
    for _ in range(reps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(BURST_MATMULS):
            a @ a
        best = max(best, (time.process_time() - cpu) / (torch.get_num_threads() * (time.perf_counter() - wall)))
    mean = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(mean)
    return min(1.0, max(float(mean) / dist.get_world_size(), expected))


def measure_optimizer(torch, dist, timer, mesh, reps: int) -> dict[str, list[tuple[int, int, float]]]:
    """{"plain"|"dtensor": [(tensors, local elements in all, seconds)]} of norm + clip + AdamW on
    sets of equal tensors, and {"model": [...]}: the same for a small GPT's parameters."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    out: dict[str, list[tuple[int, int, float]]] = {"plain": [], "dtensor": []}
    for kind in out:
        for count, numel in OPTIMIZER_SETS:
            if kind == "plain":
                params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
            else:
                params = [torch.nn.Parameter(distribute_tensor(torch.randn(numel * mesh.size()), mesh, [Shard(0)]))
                          for _ in range(count)]
            for param in params:
                param.grad = torch.randn_like(param)
            optimizer = torch.optim.AdamW(params, foreach=False if kind == "dtensor" else None, **ADAMW)

            def update():
                total = torch.zeros((), dtype=torch.float64)
                grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
                for grad in grads:  # executor.runtime.clip_grad_norm, without its one all-reduce
                    total += grad.double().pow(2).sum()
                for grad in grads:
                    grad.mul_(0.999)
                optimizer.step()

            out[kind].append((count, count * numel, timer(update, reps, cpu_time=True)))
    out["model"] = [_time_model_update(torch, reps)]
    return out


def _time_model_update(torch, reps: int) -> tuple[int, int, float]:
    """(tensors, elements, CPU seconds) of the update of a small GPT's parameters, each timed
    right after a forward and backward as in training: the activations' allocations and frees
    in between decide whether the optimizer's temporaries reuse memory or fault fresh pages,
    which the bare tensor sets do not show."""
    from planner.models import build_model

    built = build_model(OPTIMIZER_MODEL, OPTIMIZER_MODEL_SEQ, device="cpu")
    model, tokens = built.module, built.example_inputs[0].repeat(2, 1)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, **ADAMW)
    best = float("inf")
    for rep in range(reps + 1):  # the first one creates the optimizer state
        optimizer.zero_grad(set_to_none=True)
        built.loss_fn(model(tokens), (tokens,)).backward()
        begin = time.process_time()
        total = torch.zeros((), dtype=torch.float64)
        for param in params:
            total += param.grad.double().pow(2).sum()
        for param in params:
            param.grad.mul_(0.999)
        optimizer.step()
        if rep:
            best = min(best, (time.process_time() - begin) / torch.get_num_threads())
    return len(params), sum(p.numel() for p in params), best


def fit_model_update(per_tensor_s: float, model: tuple[int, int, float], fallback_s: float) -> float:
    """Seconds per parameter of a real model's update beyond its per-tensor cost (`fallback_s`,
    the tensor sets' fit, when the model's update is all per-tensor cost)."""
    tensors, elements, seconds = model
    leftover = seconds - tensors * per_tensor_s
    return leftover / elements if leftover > 0 else fallback_s


def fit_optimizer(samples: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(seconds per tensor, seconds per element) from t = tensors * a + elements * b (relative
    least squares, both clipped at 0)."""
    from planner.calibrate import _lstsq2

    rows = [(count / t, numel / t) for count, numel, t in samples]
    per_tensor, per_param = _lstsq2(rows, [1.0] * len(rows))
    if per_param <= 0:  # no bandwidth signal: all of it is per tensor
        return max(t / count for count, _, t in samples), 0.0
    return max(0.0, per_tensor), per_param


def _tiny_block(nproc: int):
    from planner.models.transformer import Block, TransformerConfig

    heads = max(4, nproc)
    hidden = heads * TINY_BLOCK["hidden_per_head"]
    return Block(TransformerConfig("gpt", 1, hidden, heads, 128, ffn=TINY_BLOCK["ffn_factor"] * hidden)), hidden


def measure_block_overheads(torch, dist, mesh, nproc: int, reps: int) -> dict[str, float]:
    """Wall seconds of a tiny block's forward + backward: plain, TP over all ranks, FSDP over all."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    seq = TINY_BLOCK["seq"]
    plain, hidden = _tiny_block(nproc)
    x = torch.randn(1, seq, hidden, requires_grad=True)

    def run(block):
        return lambda: block(x).sum().backward()

    result = {"plain_s": wall_min_s(dist, run(plain), reps), "hidden": float(hidden), "seq": float(seq)}
    tp_block, _ = _tiny_block(nproc)
    parallelize_module(tp_block, mesh, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                        "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                                        "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
    result["tp_s"] = wall_min_s(dist, run(tp_block), reps)
    fsdp_block, _ = _tiny_block(nproc)
    fully_shard(fsdp_block, mesh=mesh, reshard_after_forward=True)
    result["fsdp_s"] = wall_min_s(dist, run(fsdp_block), reps)
    result["block_params"] = float(sum(p.numel() for p in plain.parameters()))
    partial = DTensor.from_local(torch.randn(hidden), mesh, [Partial()])
    result["redistribute_s"] = wall_min_s(dist, lambda: partial.redistribute(mesh, [Replicate()]).to_local(), reps)
    return result


def measure_pipeline(torch, dist, nproc: int, reps: int) -> dict[str, float]:
    """Wall seconds of one 1F1B step of a pipeline with one tiny Linear per rank."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    width, microbatches = 16, PIPELINE_MICROBATCHES_PER_STAGE * nproc
    rank = dist.get_rank()
    stage = PipelineStage(torch.nn.Linear(width, width), stage_index=rank, num_stages=nproc,
                          device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=lambda out, target: (out - target).pow(2).mean())
    batch = torch.randn(microbatches, width)

    def step():
        if rank == 0:
            schedule.step(batch)
        elif rank == nproc - 1:
            schedule.step(target=batch)
        else:
            schedule.step()

    return {"step_s": wall_min_s(dist, step, reps), "microbatches": float(microbatches),
            "boundary_bytes": float(width * 4)}


def fit_block_overheads(block: dict[str, float], nproc: int, link) -> tuple[float, float]:
    """(TP overhead per layer per pass, FSDP overhead per layer per pass), never negative.

    TP: two all-reduces of the (1, seq, hidden) fp32 output per pass (Megatron); FSDP (ZeRO-3):
    an all-gather of the parameters per pass and a reduce-scatter of the gradients in backward.
    """
    out_bytes = block["seq"] * block["hidden"] * 4
    param_bytes = block["block_params"] * 4
    tp_comm_s = 4 * all_reduce_time_s(out_bytes, nproc, link)
    fsdp_comm_s = 2 * all_gather_time_s(param_bytes, nproc, link) + reduce_scatter_time_s(param_bytes, nproc, link)
    tp_s = max(0.0, (block["tp_s"] - block["plain_s"] - tp_comm_s) / 2)
    fsdp_s = max(0.0, (block["fsdp_s"] - block["plain_s"] - fsdp_comm_s) / 2)
    return tp_s, fsdp_s


def fit_redistribute(block: dict[str, float], nproc: int, link) -> float:
    """A small Partial -> Replicate redistribution beyond its all-reduce; never negative."""
    if "redistribute_s" not in block:
        return 0.0
    return max(0.0, block["redistribute_s"] - all_reduce_time_s(block["hidden"] * 4, nproc, link))


def fit_pipeline_action(pipeline: dict[str, float], nproc: int, link) -> float:
    """Per-action overhead: 1F1B's critical path is 2 (m + p - 1) actions and 2 (p - 1)
    boundary transfers (the tiny Linear's own compute is part of the overhead)."""
    m, p = pipeline["microbatches"], nproc
    transfers_s = 2 * (p - 1) * send_recv_time_s(pipeline["boundary_bytes"], link)
    return max(0.0, (pipeline["step_s"] - transfers_s) / (2 * (m + p - 1)))
