"""Whole-command time and peak RSS of `meshplan profile`, cold (empty cache) and warm.

Run: python benchmarks/bench_profile.py [--model SPEC] [--seq N] [--repeats K]
Target: llama3-405b at seq 8192 under 10 s and under 2 GiB RSS as a whole command.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def run_once(argv: list[str], env: dict) -> tuple[float, float, float, int]:
    """(wall seconds, CPU seconds, peak RSS in MiB, exit code) of one child process."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall_s = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    cpu_s = usage.ru_utime + usage.ru_stime  # CPU time: what the command costs when the machine is idle
    return wall_s, cpu_s, usage.ru_maxrss / 1024, child.returncode  # ru_maxrss is KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-405b")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    argv = [sys.executable, "-m", "meshplan.cli", "profile", "--model", args.model, "--seq", str(args.seq)]
    cache = tempfile.mkdtemp(prefix="meshplan-bench-cache-")
    env = {**os.environ, "MESHPLAN_CACHE_DIR": cache}
    print(f"meshplan profile --model {args.model} --seq {args.seq}  (load average {os.getloadavg()[0]:.1f},"
          f" {os.cpu_count()} CPUs)")
    try:
        for phase in ("cold", "warm"):
            for _ in range(args.repeats):
                if phase == "cold":
                    shutil.rmtree(cache, ignore_errors=True)
                wall_s, cpu_s, rss_mib, code = run_once(argv, env)
                if code != 0:
                    print(f"{phase}: exit code {code}")
                    return 1
                print(f"{phase:5s} wall {wall_s:6.2f} s   cpu {cpu_s:6.2f} s   peak RSS {rss_mib:7.1f} MiB")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
