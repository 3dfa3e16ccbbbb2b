"""Where one training step of a one-rank plan spends its time: `meshplan train`'s own runtime,
stepped in this process under torch.profiler.

    python benchmarks/gpu_step_profile.py PLAN.json [--steps 2] [--warmup 3]

Prints one JSON object: the step's wall time; the device's busy time (the union of its kernels'
intervals; on CPU the operators' own time stands in); the kernels and operators launched per step;
kernel time by kind (`KERNEL_KINDS`: matmul, attention, optimizer, communication, copy, the
memory-bound rest); the top kernels and host operators by time; and the time under FSDP2's hooks. Set beside the
plan's predicted step time, it says whether a gap is kernels that run slower than priced, kernels
the model does not price (casts, copies), or a device that waits for its host. A plan for more
than one rank is refused (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

TOP = 12
# Kernel kinds by name (first match wins), to set beside the cost model's terms: fused attention,
# matmuls (cuBLAS's nvjet / cutlass / xmma kernels), the optimizer's multi-tensor kernels,
# collectives, copies, and the memory-bound rest (elementwise, reductions, norms, casts).
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "sdpa", "attention")),  # before matmul: cuDNN's carry sm90 / wgmma
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma")),
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("communication", ("nccl",)),
    ("copy", ("memcpy", "memset")),
)


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (microseconds)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy


def kernel_kind(name: str) -> str:
    """The `KERNEL_KINDS` kind of a kernel name ("memory-bound" for the rest)."""
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "memory-bound"


def _summarise(prof, steps: int, device_type: str) -> dict:
    from torch.autograd import DeviceType

    events = prof.events()
    # record_function ranges show on the GPU timeline too (torch >= 2.4: is_user_annotation): not kernels
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    by_kernel: dict[str, float] = {}
    for e in kernels:
        by_kernel[e.name] = by_kernel.get(e.name, 0.0) + e.time_range.elapsed_us()
    by_op: dict[str, float] = {}
    for e in host:
        by_op[e.name] = by_op.get(e.name, 0.0) + e.self_cpu_time_total
    fsdp_us = sum(e.cpu_time_total for e in host if e.name.startswith("FSDP::") and e.cpu_parent is None)
    if kernels:
        busy_us = _busy_us([(e.time_range.start, e.time_range.end) for e in kernels])
    else:  # CPU: the operators' own time is the device's work
        busy_us = sum(e.self_cpu_time_total for e in host if not e.name.startswith(("FSDP::", "ProfilerStep")))

    def top(table):
        return [(name[:90], round(us / steps / 1e3, 3)) for name, us in
                sorted(table.items(), key=lambda kv: -kv[1])[:TOP]]
    by_kind: dict[str, float] = {}
    for name, us in by_kernel.items():
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us / steps / 1e3
    return {"device": device_type, "device_busy_ms_per_step": busy_us / steps / 1e3,
            "kernel_ms_per_step_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "kernels_per_step": len(kernels) / steps, "host_ops_per_step": len(host) / steps,
            "fsdp_hook_host_ms_per_step": fsdp_us / steps / 1e3,
            "top_kernels_ms_per_step": top(by_kernel), "top_host_ops_self_ms_per_step": top(by_op)}


def profile_plan(plan_path: str, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from meshplan.executor.data import global_batch, make_source, token_vocab
    from meshplan.executor.runtime import Hyperparameters, build_runtime, train_step
    from meshplan.planner.contracts.plan import load_plan

    plan = load_plan(plan_path)
    if plan.config.gpus != 1:
        raise SystemExit(f"gpu_step_profile: the plan is for {plan.config.gpus} ranks; it steps one-rank plans")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        hp = Hyperparameters()
        runtime = build_runtime(plan, device, hp, plan.seed)
        source = make_source("synthetic", token_vocab(plan.model.spec, plan.model.seq), plan.model.seq, plan.seed)
        total = warmup + steps

        def one(step):
            inputs, targets = global_batch(source, step, plan.config.global_batch)
            started = time.perf_counter()
            train_step(runtime, step, total, inputs, targets, hp)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - started

        for step in range(warmup):
            one(step)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            walls = [one(warmup + step) for step in range(steps)]
        plain = [one(total + step) for step in range(steps)]  # the profiler's own cost left out
        out = {"plan": os.path.basename(plan_path), "predicted_step_time_s": (plan.prediction or {}).get("step_time_s"),
               "num_microbatches": plan.config.num_microbatches, "dp_method": runtime.dp_method,
               "wall_ms_per_step_profiled": statistics.median(walls) * 1e3,
               "wall_ms_per_step": statistics.median(plain) * 1e3}
        out.update(_summarise(prof, steps, device.type))
        return out
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="a one-rank plan.json (`meshplan plan --gpus 1`)")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the profiled ones")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.plan):
        print(f"gpu_step_profile: no plan at {args.plan}; make one with `meshplan plan --gpus 1 --out PLAN`",
              file=sys.stderr)
        return 2
    print(json.dumps(profile_plan(args.plan, args.steps, args.warmup)), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    sys.exit(main())
