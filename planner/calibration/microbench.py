"""`calibrate`'s measurements of the fixed costs `planner.costing.fixed_costs` charges, and their fits.

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
  of TP and of the data-parallel wrapper; TP is also timed on a block of a small real model's
  shape, each against the local shard one rank computes, which splits TP's overhead into a
  fixed part and a part per byte of the activations; FSDP is timed on that shape too, keeping
  and resharding its gathered parameters, which splits its overhead into a fixed part and a
  part per byte gathered or reduced;
- a pipeline of one GPT block per rank under torch's 1F1B schedule: its step time less the
  cost model's compute of the blocks on the critical path, over the number of actions on it,
  is the per-action overhead (hand-offs, stage bookkeeping, waits on real activations).
"""
from __future__ import annotations

import time


# The executor's AdamW and clipping settings (executor.runtime.Hyperparameters defaults).
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# (number of tensors, elements each): per-tensor dominated, mixed, and bandwidth dominated, at the
# sizes of small models' biases, norms and Linears.
OPTIMIZER_SETS = ((64, 1024), (16, 2**16), (4, 2**18))
# A small model whose update the per-parameter cost is taken from (see _time_model_update).
OPTIMIZER_MODEL, OPTIMIZER_MODEL_SEQ = "gpt:layers=2,hidden=256,heads=4,vocab=4096", 64
TINY_BLOCK = {"heads": 4, "hidden_per_head": 16, "ffn_factor": 4, "seq": 8}
# A block of the shape class of the small GPTs meshplan trains on CPU (hidden 256, seq 128, a
# micro-batch of 8, a 4096 vocabulary): DTensor's overhead there grows with the activations.
REAL_BLOCK = {"heads": 4, "hidden_per_head": 64, "ffn_factor": 4, "seq": 128, "batch": 8, "vocab": 4096}
# Repetitions of the wall-clock fixed-cost timings (tiny, so cheap): their minimum is the least
# disturbed by other processes.
MIN_WALL_REPS = 8
# 256 x 256 matmuls in one burst of measure_cpu_share: ~0.2 s of one core.
BURST_MATMULS = 400
PIPELINE_MICROBATCHES_PER_STAGE = 4
PIPELINE_BLOCK_SEQ = 128  # = compute_bench.TRAFFIC_SHAPES[0]: the block's compute is costed from that sample


def wall_min_s(dist, fn, reps: int) -> float:
    """Fastest of `reps` wall-clock runs of a collective `fn`, every rank starting together."""
    return wall_min_interleaved_s(dist, {"fn": fn}, reps)["fn"]


def wall_min_interleaved_s(dist, fns: dict, reps: int) -> dict[str, float]:
    """`wall_min_s` of several collective functions measured in alternation (a, b, c, a, b, c,
    ...): the overheads are differences of these minima, and alternating keeps a slow spell of
    a shared machine from landing on one side of a difference only."""
    for _ in range(2):  # warm-up: allocations, connections, DTensor sharding caches
        for fn in fns.values():
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(max(reps, MIN_WALL_REPS)):
        for name, fn in fns.items():
            dist.barrier()
            begin = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - begin)
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
    from meshplan.planner.models.registry import build_model
    from meshplan.planner.models.transformer import init_weights

    built = build_model(OPTIMIZER_MODEL, OPTIMIZER_MODEL_SEQ, device="cpu")
    model = built.module
    # Weights and tokens as training has them: the default init with all-zero tokens saturates
    # the softmax, and most gradients come out denormal, which AdamW then updates ~3x slower.
    init_weights(model, seed=0)
    tokens = torch.randint(0, model.cfg.vocab, (2, OPTIMIZER_MODEL_SEQ), generator=torch.Generator().manual_seed(0))
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


def _block(nproc: int, shape: dict, local: bool = False):
    """A GPT block of `shape`; `local`: the shard one rank of a TP group computes (its heads and
    its slice of the MLP, full hidden), so TP block minus local block is DTensor's overhead."""
    from torch import nn

    from meshplan.planner.models.transformer import Block, TransformerConfig

    heads = nproc * -(-shape["heads"] // nproc)  # at least shape's heads, a multiple of nproc
    hidden = heads * shape["hidden_per_head"]
    ffn = shape["ffn_factor"] * hidden
    block = Block(TransformerConfig("gpt", 1, hidden, heads, 128, ffn=ffn))
    if local:
        for name in ("q", "k", "v"):
            setattr(block.attn, name, nn.Linear(hidden, hidden // nproc))
        block.attn.o = nn.Linear(hidden // nproc, hidden)
        block.mlp.up, block.mlp.down = nn.Linear(hidden, ffn // nproc), nn.Linear(ffn // nproc, hidden)
    return block, hidden


def _tp_block(mesh, nproc: int, shape: dict, sp: bool = False):
    """The executor's Megatron layout (`planner.models.tensor_parallel`), with or without sequence
    parallelism."""
    from torch.distributed.tensor.parallel import parallelize_module

    from meshplan.planner.models.tensor_parallel import block_tp_plan

    block, _ = _block(nproc, shape)
    parallelize_module(block, mesh, block_tp_plan(block, sp))
    return block


def measure_block_overheads(torch, dist, mesh, nproc: int, reps: int) -> dict[str, float]:
    """Wall seconds of a block's forward + backward: plain, TP over all ranks, FSDP over all,
    for the tiny block, and local shard vs TP for the tiny and the real-shape block."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate

    torch.manual_seed(0)
    seq = TINY_BLOCK["seq"]
    plain, hidden = _block(nproc, TINY_BLOCK)
    x = torch.randn(1, seq, hidden, requires_grad=True)

    def run(block, inputs=x):
        return lambda: block(inputs).sum().backward()

    fsdp_block, _ = _block(nproc, TINY_BLOCK)
    fully_shard(fsdp_block, mesh=mesh, reshard_after_forward=True)
    result = wall_min_interleaved_s(dist, {
        "plain_s": run(plain), "tp_s": run(_tp_block(mesh, nproc, TINY_BLOCK)),
        "local_s": run(_block(nproc, TINY_BLOCK, local=True)[0]), "fsdp_s": run(fsdp_block)}, 2 * reps)
    result.update(hidden=float(hidden), seq=float(seq), block_params=float(sum(p.numel() for p in plain.parameters())))
    partial = DTensor.from_local(torch.randn(hidden), mesh, [Partial()])
    result["redistribute_s"] = wall_min_s(dist, lambda: partial.redistribute(mesh, [Replicate()]).to_local(), reps)
    result.update(_measure_real_shape_tp(torch, dist, mesh, nproc, reps))
    result.update(_measure_real_shape_fsdp(torch, dist, mesh, nproc, reps))
    return result


def _measure_real_shape_fsdp(torch, dist, mesh, nproc: int, reps: int) -> dict[str, float]:
    """The real-shape block plain and under `fully_shard` over all ranks, keeping its gathered
    parameters until backward (ZeRO-1/2: one all-gather and one reduce-scatter) and resharding
    after forward (ZeRO-3: two all-gathers): with the tiny block's FSDP timing, FSDP2's host work
    that grows with the parameter bytes (copy-in and copy-out of the flat buffers around each
    collective), apart for gathers and reductions."""
    from torch.distributed.fsdp import fully_shard

    shape = REAL_BLOCK
    plain, hidden = _block(nproc, shape)
    kept, _ = _block(nproc, shape)
    resharded, _ = _block(nproc, shape)
    fully_shard(kept, mesh=mesh, reshard_after_forward=False)
    fully_shard(resharded, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(shape["batch"], shape["seq"], hidden, requires_grad=True)
    out = wall_min_interleaved_s(dist, {"real_plain_s": lambda: plain(x).sum().backward(),
                                        "real_fsdp_kept_s": lambda: kept(x).sum().backward(),
                                        "real_fsdp_s": lambda: resharded(x).sum().backward()}, reps)
    out["real_block_params"] = float(sum(p.numel() for p in plain.parameters()))
    return out


def _measure_real_shape_tp(torch, dist, mesh, nproc: int, reps: int) -> dict[str, float]:
    """Local shard vs TP block (with and without sequence parallelism) at a small real model's
    shape: DTensor's cost that grows with the activations, which the tiny block cannot show;
    and the vocab-parallel loss (`loss_parallel` cross entropy) on that shape's logits."""
    shape = REAL_BLOCK
    local, hidden = _block(nproc, shape, local=True)
    x = torch.randn(shape["batch"], shape["seq"], hidden, requires_grad=True)
    x_sp = torch.randn(shape["batch"], shape["seq"] // nproc, hidden, requires_grad=True)
    tp_block, sp_block = _tp_block(mesh, nproc, shape), _tp_block(mesh, nproc, shape, sp=True)
    out = wall_min_interleaved_s(dist, {"real_local_s": lambda: local(x).sum().backward(),
                                        "real_tp_s": lambda: tp_block(x).sum().backward(),
                                        "real_sp_s": lambda: sp_block(x_sp).sum().backward()}, reps)
    out["real_stream_bytes"] = float(x.numel() * x.element_size())
    out.update(_measure_vocab_parallel_loss(torch, dist, mesh, nproc, reps))
    return out


def _measure_vocab_parallel_loss(torch, dist, mesh, nproc: int, reps: int) -> dict[str, float]:
    """Cross entropy forward + backward on vocab-sharded logits under `loss_parallel` (as the
    executor's TP head runs it) and on the local shard alone (the same compute, no DTensor)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    shape = REAL_BLOCK
    tokens = shape["batch"] * shape["seq"]
    local_logits = torch.randn(tokens, shape["vocab"] // nproc, requires_grad=True)
    local_targets = torch.randint(0, shape["vocab"] // nproc, (tokens,))
    targets = torch.randint(0, shape["vocab"], (tokens,))  # replicated, over the whole vocabulary
    sharded = DTensor.from_local(torch.randn(tokens, shape["vocab"] // nproc), mesh, [Shard(1)]).requires_grad_()

    def parallel():
        with loss_parallel():
            F.cross_entropy(sharded, targets).backward()

    out = wall_min_interleaved_s(dist, {"loss_local_s": lambda: F.cross_entropy(local_logits, local_targets).backward(),
                                        "loss_parallel_s": parallel}, reps)
    return {**out, "loss_tokens": float(tokens)}


def measure_pipeline(torch, dist, nproc: int, reps: int) -> dict[str, float]:
    """Wall seconds of one 1F1B step of a pipeline with one GPT block (hidden 256, micro-batches
    of one 128-token sample) per rank: the shape of the small models meshplan trains here, so
    the per-action cost includes what torch's stages do with real activations."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    from meshplan.planner.models.transformer import Block, TransformerConfig

    seq, hidden, microbatches = PIPELINE_BLOCK_SEQ, 256, PIPELINE_MICROBATCHES_PER_STAGE * nproc
    rank = dist.get_rank()
    stage = PipelineStage(Block(TransformerConfig("gpt", 1, hidden, 4, 1024)), stage_index=rank,
                          num_stages=nproc, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=lambda out, target: (out * target).mean())
    batch = torch.randn(microbatches, seq, hidden)

    def step():
        if rank == 0:
            schedule.step(batch)
        elif rank == nproc - 1:
            schedule.step(target=batch)
        else:
            schedule.step()

    return {"step_s": wall_min_s(dist, step, reps), "microbatches": float(microbatches),
            "boundary_bytes": float(seq * hidden * 4)}


