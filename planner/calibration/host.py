"""The conditions CPU processes run in, set alike where meshplan measures and where it trains:
how they allocate tensor memory, how many threads each computes with, and when a host or a
calibration was too disturbed for its timings to judge a prediction by.

glibc hands allocations above its mmap threshold (dynamic, at most 32 MiB by default) straight
to the kernel and returns them on free, and trims the heap's free top: every large activation
of every step then faults in fresh zeroed pages. Measured on a 2-core VM: out-of-place
elementwise ops on tensors of 8 MiB and more ran at 4-6 GB/s against 17-19 GB/s below, and a
small GPT's head and loss at 512 tokens per sample (33 MiB of logits) took 169 ms against 128 ms
with freed memory kept for reuse. GPUs do this through torch's caching allocator; on CPU
`reuse_freed_memory` asks glibc for the same: no mmap below 1 GiB, no trimming below 1 GiB free.
`calibrate`'s CPU workers and `meshplan train`'s CPU workers both call it, so the profile's
rates are the rates training runs at.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import statistics
from typing import Mapping

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BYTES = 1 << 30


def reuse_freed_memory() -> bool:
    """Keep freed memory in the process heap for reuse (glibc only); whether it took effect."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator as it is
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))


# Other work on a host, in CPUs beyond meshplan's own processes, above which what meshplan
# measures there in wall-clock time (training steps, collectives) is that work's as much as its
# own: half the host. Calibration and the report's predicted-vs-measured judge by this one rule.
BUSY_HOST_SHARE = 0.5


def busy_host(load_avg: float, num_cpus: int, own_processes: int) -> str:
    """'load average L on N CPU(s) with P process(es): other work kept about O CPU(s) busy' when
    that exceeds BUSY_HOST_SHARE of the CPUs, else ''."""
    others = load_avg - own_processes  # CPUs that other work kept busy
    if num_cpus <= 0 or others <= BUSY_HOST_SHARE * num_cpus:
        return ""
    return (f"load average {load_avg:.1f} on {num_cpus} CPU(s) with {own_processes} worker(s): other work kept "
            f"about {others:.1f} CPU(s) busy")


def threads_per_process(nproc: int, environ: Mapping[str, str] | None = None) -> int:
    """Threads each of `nproc` CPU processes computes with, calibrating and training alike: the
    environment's OMP_NUM_THREADS when it sets a positive count, else the CPUs shared out
    (at least one). `meshplan train` exports it to its workers; `calibrate`'s workers set it."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


# Repeats of one measurement that spread by more than this ((max - min) / median) cannot judge a
# prediction to the report's 15% flag threshold (`reports.compare.DEFAULT_FLAG_FRACTION`).
MAX_SPREAD = 0.15


def relative_spread(values) -> float:
    """(max - min) / median of repeated timings of one thing; 0 for fewer than two."""
    values = [float(v) for v in values]
    if len(values) < 2 or statistics.median(values) <= 0:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


def noisy_rounds(conditions) -> list[str]:
    """One sentence per part of a calibration (compute, link) whose rounds spread beyond MAX_SPREAD."""
    return [f"calibration's {what} timings spread {spread:.0%} over {conditions.rounds} rounds (above {MAX_SPREAD:.0%})"
            for what, spread in (("compute", conditions.compute_spread), ("link", conditions.link_spread))
            if spread > MAX_SPREAD]


def calibration_problems(conditions, world_size: int | None = None, threads: int | None = None) -> list[str]:
    """Why a profile's calibration (`contracts.cluster.CalibrationConditions`) cannot judge a CPU run
    of `world_size` processes with `threads` threads each: its repeats spread beyond MAX_SPREAD,
    other work loaded the host (`busy_host`), or it measured with other processes or threads than
    the run (each process's share of the cores, and so its rates, differ). [] when none."""
    if conditions is None:
        return []
    out = noisy_rounds(conditions)
    busy = busy_host(conditions.load_avg_1m, conditions.num_cpus, conditions.processes)
    if busy:
        out.append(f"calibrated on a busy host ({busy})")
    if world_size is not None and (world_size != conditions.processes
                                   or (threads is not None and threads != conditions.threads_per_process)):
        ran = f"{world_size} x {threads if threads is not None else '?'}"
        out.append(f"calibrated with {conditions.processes} process(es) x {conditions.threads_per_process} "
                   f"thread(s), trained with {ran}: calibrate with --nproc {world_size} and the same OMP_NUM_THREADS")
    return out
