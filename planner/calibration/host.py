"""How CPU processes allocate tensor memory, set alike where meshplan measures and where it trains.

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
