"""Preflight of `train`: does this plan fit this machine? Checked before any worker starts.

A plan made for 64 H100s, launched here on CPU, starts 64 processes that exhaust the host's
memory minutes later. `preflight_refusal` compares the plan's device kind, world size and
predicted per-rank memory with what this machine has (`Machine`: usable CPUs, available RAM,
GPUs and their memory) and returns one line saying what cannot run and what would (the plan
re-made for this machine), or None. `train(..., force=True)` / `meshplan train --force` skips it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# Ranks per usable CPU core beyond which a CPU run is refused: gloo ranks busy-wait in their
# collectives, so with more ranks than this per core the measured step is the scheduler's.
MAX_RANKS_PER_CPU = 8


@dataclass(frozen=True)
class Machine:
    """What this machine offers the workers."""

    num_cpus: int
    ram_available_bytes: float
    num_gpus: int = 0
    gpu_memory_bytes: float = 0.0  # the smallest visible GPU's
    gpu_name: str = ""

    def __post_init__(self):
        if self.num_cpus < 1 or self.ram_available_bytes <= 0:
            raise ValueError(f"a machine needs >= 1 CPU and some RAM, got {self.num_cpus} CPUs, "
                             f"{self.ram_available_bytes} bytes")
        if self.num_gpus < 0 or (self.num_gpus and self.gpu_memory_bytes <= 0):
            raise ValueError(f"{self.num_gpus} GPUs with {self.gpu_memory_bytes} bytes each")


def this_machine() -> Machine:
    """The CPUs this process may run on, MemAvailable, and the CUDA devices torch sees."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus, gpu_bytes, gpu_name = 0, 0.0, ""
    try:
        import torch

        if torch.cuda.is_available():
            gpus = torch.cuda.device_count()
            props = [torch.cuda.get_device_properties(i) for i in range(gpus)]
            gpu_bytes = float(min(p.total_memory for p in props))
            gpu_name = props[0].name
    except ImportError:
        pass
    return Machine(num_cpus=max(1, cpus), ram_available_bytes=_ram_available_bytes(), num_gpus=gpus,
                   gpu_memory_bytes=gpu_bytes, gpu_name=gpu_name)


def _ram_available_bytes() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_is_for_gpus(plan) -> bool:
    """The planning rule for GPUs (`estimator.default_precision`): bf16 computes faster than fp32."""
    from meshplan.planner.simulation.estimator import default_precision

    return default_precision(plan.cluster) != "fp32"


def predicted_rank_bytes(plan) -> float:
    """The plan's predicted peak per rank (its largest pipeline rank), 0 when it has no prediction."""
    return float((plan.prediction or {}).get("peak_memory_bytes", 0.0))


def preflight_refusal(plan, nproc: int, machine: Machine) -> str | None:
    """One line when the plan cannot run here as planned (what, and what would run), else None."""
    gib = 2**30
    cfg = plan.config
    peak = predicted_rank_bytes(plan)
    if plan_is_for_gpus(plan):
        what = f"the plan is for {cfg.gpus} x {plan.cluster.device.name}"
        if machine.num_gpus == 0:
            return (f"{what} but this machine has no GPU (the workers would run {nproc} CPU processes); "
                    f"{_remake(plan, machine)}, or --force to launch anyway")
        if nproc > machine.num_gpus:
            return (f"{what} ({nproc} processes) but this machine has {machine.num_gpus} GPU(s); "
                    f"{_remake(plan, machine)}, or --force to launch anyway")
        if peak > machine.gpu_memory_bytes:
            return (f"{what}, predicted at {peak / gib:.1f} GiB per GPU, but this machine's {machine.gpu_name} "
                    f"holds {machine.gpu_memory_bytes / gib:.1f} GiB; {_remake(plan, machine)}, or --force")
        return None
    if nproc > MAX_RANKS_PER_CPU * machine.num_cpus:
        return (f"{nproc} processes on {machine.num_cpus} CPU(s) is more than {MAX_RANKS_PER_CPU} per CPU; "
                f"{_remake(plan, machine)}, or --force to launch anyway")
    need = nproc * (peak + plan.cluster.device.reserved_memory_bytes)
    if need > machine.ram_available_bytes:
        return (f"{nproc} processes need about {need / gib:.1f} GiB ({peak / gib:.2f} GiB predicted per rank + "
                f"{plan.cluster.device.reserved_memory_bytes / gib:.2f} GiB runtime each) but "
                f"{machine.ram_available_bytes / gib:.1f} GiB of RAM is available; {_remake(plan, machine)}, "
                "or --force to launch anyway")
    return None


def _remake(plan, machine: Machine) -> str:
    """The `meshplan plan` command that re-makes this job for this machine."""
    cfg = plan.config
    if machine.num_gpus:
        cluster, count = plan.cluster.name, machine.num_gpus
    else:
        cluster = "cpu"
        count = max(d for d in range(1, min(machine.num_cpus, cfg.global_batch) + 1) if cfg.global_batch % d == 0)
    from meshplan.planner.models.plan_check import is_sequence_model

    seq = f" --seq {plan.model.seq}" if is_sequence_model(plan.model.spec) else ""
    return (f"re-make the plan for this machine: meshplan plan --model {plan.model.spec} --cluster {cluster} "
            f"--gpus {count} --gbs {cfg.global_batch}{seq} --out plan-here.json")
