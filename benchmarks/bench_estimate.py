"""Speed of `estimate` for a 1T-parameter GPT on 3072 A100s (Narayanan et al. 2021's largest run).

Prints the in-process time of `planner.simulation.estimator.estimate` (profile cache warm, then the
configuration check, the cost model and the event-driven simulation of 64 stages x 512
micro-batches, forward and backward) and the wall time of the whole `meshplan estimate` command in a fresh
process, cold (empty profile cache) and warm. Targets: under 1 s in-process, under 5 s per
command. Run: python benchmarks/bench_estimate.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

SPEC = "gpt:layers=128,hidden=25600,heads=160,vocab=51200"
ARGS = ["--model", SPEC, "--cluster", "a100-80g", "--gpus", "3072", "--gbs", "3072", "--seq", "2048",
        "--tp", "8", "--pp", "64", "--mbs", "1", "--recompute", "full", "--json"]


def command_s(env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "meshplan.cli", "estimate", *ARGS], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "MESHPLAN_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        cold_s = command_s(env)
        warm_s = command_s(env)
        os.environ["MESHPLAN_CACHE_DIR"] = cache
        from meshplan.planner.simulation.estimator import estimate

        runs = []
        for _ in range(3):
            start = time.perf_counter()
            prediction = estimate(SPEC, "a100-80g", gpus=3072, global_batch=3072, seq=2048, tp=8, pp=64, mbs=1,
                                  recompute="full")
            runs.append(time.perf_counter() - start)
    print(f"1T GPT ({SPEC}, seq 2048) on 3072 x a100-80g, tp 8 pp 64 dp 6, 512 micro-batches of 1 per replica")
    print(f"  predicted step {prediction.step_time_s:.2f} s, {prediction.model_tflops_per_gpu:.1f} model TFLOP/s "
          f"per GPU, MFU {prediction.mfu:.1%}, peak memory {prediction.peak_memory_bytes / 2**30:.1f} GiB")
    print(f"  in-process estimate():          {min(runs):.3f} s (best of 3; target < 1 s)")
    print(f"  whole command, cold cache:      {cold_s:.2f} s (profiles the model; target < 5 s)")
    print(f"  whole command, warm cache:      {warm_s:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
