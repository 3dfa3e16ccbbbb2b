"""Planner speed: the whole `meshplan plan` command in a fresh process, median of 5 runs.

Cases and targets on a 2-core machine (every axis searched: CP, HSDP, zero-bubble schedules, and
EP for the mixture of experts):
- llama3-405b on 16384 x h100-sxm, gbs 2048, seq 8192: under 10 s
- qwen3-235b-a22b on 256 x h100-sxm, gbs 1024, seq 4096: under 10 s
- llama3-70b on 1024 x h100-sxm, gbs 1024, seq 8192: under 5 s
- DeepSeek-V3 (its Hugging Face config) on 2048 x h100-sxm, gbs 4096, seq 4096: under 20 s
- gpt-oss-120b (alternating sliding-window and full-attention blocks: the compact ILP on their
  envelope, `search.ilp.envelope`) on 64 x h100-sxm, gbs 512, seq 4096: under 20 s
- DeepSeek-V3 again under `--engine megatron`, whose space (unlike meshplan's executor's) holds
  expert and tensor parallelism for a traced mixture of experts: under 20 s
- gpt-oss-120b again under `--engine megatron` (expert and tensor parallelism searched: about five
  times the candidates; most ruled out by memory, which the memory-aware bound on the periodic
  blocks' floor, `search.bounds.bound_table`, proves before their ILPs): under 10 s
- DeepSeek-V3 under `--engine megatron` with its multi-token-prediction depth (`--mtp-num-layers
  1`, pinned with the output layer to the last chunk): under 20 s, DeepSeek-V3's target
Each run prints how many candidates were solved and pruned by which bound (`search.bounds`),
and the wall-clock and CPU (user + sys, worker processes included) medians against the targets.
Run: `python benchmarks/bench_plan.py` (`--runs N` for another count, `--cases gpt-oss` for the cases
whose model names contain that text).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "planner" / "models" / "hf_configs"
CASES = [  # (model, gpus, global batch, sequence, target seconds, engine[, more `plan` arguments])
    ("llama3-405b", 16384, 2048, 8192, 10.0, "meshplan"),  # Llama 3: 16M tokens per step at 8K = 2048 sequences
    ("qwen3-235b-a22b", 256, 1024, 4096, 10.0, "meshplan"),
    ("llama3-70b", 1024, 1024, 8192, 5.0, "meshplan"),
    # DeepSeek-V3's published config (671 B, multi-head latent attention), traced through transformers
    (f"hf:{FIXTURES / 'deepseek_v3.json'}", 2048, 4096, 4096, 20.0, "meshplan"),
    ("gpt-oss-120b", 64, 512, 4096, 20.0, "meshplan"),
    (f"hf:{FIXTURES / 'deepseek_v3.json'}", 2048, 4096, 4096, 20.0, "megatron"),
    ("gpt-oss-120b", 64, 512, 4096, 10.0, "megatron"),
    (f"hf:{FIXTURES / 'deepseek_v3.json'}", 2048, 4096, 4096, 20.0, "megatron", ("--mtp-num-layers", "1")),
]


def plan_command(spec: str, gpus: int, gbs: int, seq: int, engine: str, extra: tuple[str, ...] = ()
                 ) -> tuple[float, float, dict]:
    """Wall time and CPU time (user + sys of the process and its workers) of one `meshplan plan
    --json` in a new process with an empty cache, and its plan."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "MESHPLAN_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        args = ["--model", spec, "--cluster", "h100-sxm", "--gpus", str(gpus), "--gbs", str(gbs), "--seq", str(seq),
                "--engine", engine, *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "meshplan.cli", "plan", *args, "--json"], env=env, check=True,
                              capture_output=True, text=True)
        elapsed_s = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed_s, cpu_s, json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cases", default="", help="only the cases whose model contains this text")
    args = parser.parse_args()
    cases = [case for case in CASES if args.cases in case[0]]
    if not cases:
        parser.error(f"--cases {args.cases!r} matches none of {', '.join(case[0] for case in CASES)}")
    print(f"whole `meshplan plan` command (new process, empty cache), median of {args.runs} runs; wall clock "
          f"(the target) and CPU (user + sys, workers included: steadier on a shared machine)")
    summary = []
    for spec, gpus, gbs, seq, target_s, engine, *more in cases:
        extra = more[0] if more else ()
        runs = [plan_command(spec, gpus, gbs, seq, engine, extra) for _ in range(args.runs)]
        times_s = sorted(elapsed for elapsed, _, _ in runs)
        median_s = statistics.median(times_s)
        cpu_s = statistics.median(cpu for _, cpu, _ in runs)
        plan = runs[-1][2]
        solver, mesh, sched = plan["solver"], plan["mesh"], plan["schedule"]
        print(f"{spec} on {gpus} x h100-sxm, gbs {gbs}, seq {seq}, --engine {engine} {' '.join(extra)}".rstrip())
        print(f"  whole command: median {median_s:.1f} s wall (min {times_s[0]:.1f}, max {times_s[-1]:.1f}), "
              f"{cpu_s:.1f} s CPU; target < {target_s:.0f} s: {'met' if median_s < target_s else 'MISSED'}")
        print(f"  candidates {solver['num_candidates']}: solved {solver['num_solved']}, pruned by the compute bound "
              f"{solver['num_pruned_bound']}, by the memory-aware bound {solver.get('num_pruned_memory_bound', 0)}, "
              f"no assignment fits {solver['num_pruned_memory']}, expert-degree rule "
              f"{solver.get('num_pruned_expert_degree', 0)}; cut off in the ILP {solver['num_cutoff']}")
        print(f"  winner: {' '.join(f'{k} {v}' for k, v in mesh.items())}, {sched['name']} x{sched['virtual_stages']}, "
              f"mbs {sched['microbatch_size']}, ZeRO-{plan['zero']}; ILP objective {solver['ilp_objective_s']:.3f} s, "
              f"simulated {plan['prediction']['step_time_s']:.3f} s")
        label = Path(spec).name + ("" if engine == "meshplan" else f" ({engine})") + (" +mtp" if extra else "")
        summary.append((label, median_s, cpu_s, target_s))
    print("summary (median wall / CPU against the target):")
    for spec, median_s, cpu_s, target_s in summary:
        print(f"  {spec:28s} {median_s:6.1f} s wall {cpu_s:6.1f} s CPU   target < {target_s:4.0f} s  "
              f"{'met' if median_s < target_s else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
