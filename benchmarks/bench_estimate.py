"""Speed of a cold `meshplan estimate` on parametric models: the whole command in a fresh process.

Two configurations: the 1T-parameter GPT on 3072 A100s (Narayanan et al. 2021's largest run;
64 stages x 512 micro-batches simulated forward and backward) and llama3-70b on 64 H100s. Each
run is a new interpreter with an empty profile cache (`$MESHPLAN_CACHE_DIR` pointed at a fresh
directory), so nothing computed by an earlier run helps; zoo models need no cache anyway, as
their layer graph is computed in closed form without importing torch. Prints the median of 5
runs per configuration, wall clock (the target) and CPU (user + sys). Target: under 1 s per
cold estimate of a parametric model.
Run: python benchmarks/bench_estimate.py
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

NUM_RUNS = 5
TARGET_S = 1.0
CONFIGS = {
    "1T GPT on 3072 x a100-80g (tp 8, pp 64, dp 6, full recomputation)": [
        "--model", "gpt:layers=128,hidden=25600,heads=160,vocab=51200", "--cluster", "a100-80g", "--gpus", "3072",
        "--gbs", "3072", "--seq", "2048", "--tp", "8", "--pp", "64", "--mbs", "1", "--recompute", "full"],
    "llama3-70b on 64 x h100-sxm (tp 8, pp 2, dp 4, seq 8192)": [
        "--model", "llama3-70b", "--cluster", "h100-sxm", "--gpus", "64", "--gbs", "64", "--seq", "8192",
        "--tp", "8", "--pp", "2"],
}


def cold_command(args: list[str]) -> tuple[float, float, dict]:
    """Wall time and CPU time (user + sys) of one `meshplan estimate --json` in a new process with
    an empty cache, and its output."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "MESHPLAN_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "meshplan.cli", "estimate", *args, "--json"], env=env,
                              check=True, capture_output=True, text=True)
        elapsed_s = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed_s, cpu_s, json.loads(done.stdout)


def main() -> int:
    print(f"cold `meshplan estimate` (new process, empty profile cache), median of {NUM_RUNS} runs; "
          f"target < {TARGET_S:.0f} s")
    for title, args in CONFIGS.items():
        runs = [cold_command(args) for _ in range(NUM_RUNS)]
        times_s = sorted(elapsed for elapsed, _, _ in runs)
        cpu_s = statistics.median(cpu for _, cpu, _ in runs)
        prediction = runs[-1][2]
        median_s = statistics.median(times_s)
        print(f"{title}")
        print(f"  predicted step {prediction['step_time_s']:.2f} s, MFU {prediction['mfu']:.1%}, "
              f"peak memory {prediction['peak_memory_bytes'] / 2**30:.1f} GiB")
        print(f"  whole command: median {median_s:.2f} s wall (min {times_s[0]:.2f}, max {times_s[-1]:.2f}), "
              f"{cpu_s:.2f} s CPU; target < {TARGET_S:.0f} s: {'met' if median_s < TARGET_S else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
