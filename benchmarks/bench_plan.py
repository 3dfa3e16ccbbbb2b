"""Planner speed: llama3-70b on 1024 H100 and llama3-405b on 16384 H100, both at 8K sequence.

Targets on a 2-core machine: 70B under 10 s, 405B under 60 s, with the winner's optimality gap 0
or under 1%. Profiling (meta-device tracing, cached per process) is timed separately from the
search. Run: `python benchmarks/bench_plan.py`.
"""
from __future__ import annotations

import time

from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile
from meshplan import plan

CASES = [  # (model, gpus, global batch, sequence, target seconds)
    ("llama3-70b", 1024, 1024, 8192, 10.0),
    ("llama3-405b", 16384, 2048, 8192, 60.0),  # Llama 3: 16M tokens per step at 8K = 2048 sequences
]


def main() -> None:
    cluster = load_cluster("h100-sxm")
    for spec, gpus, gbs, seq, target_s in CASES:
        started = time.perf_counter()
        graph = profile(spec, seq, batch=1, dtype="bf16", attention="flash")
        profile_s = time.perf_counter() - started
        started = time.perf_counter()
        result = plan(spec, cluster, gpus, gbs, seq, graph=graph)
        search_s = time.perf_counter() - started
        cfg, solver, pred = result.config, result.solver, result.prediction
        print(f"{spec} on {gpus} x {cluster.name}, gbs {gbs}, seq {seq}")
        print(f"  profile {profile_s:6.1f} s   plan {search_s:6.1f} s (target < {target_s:.0f} s: "
              f"{'met' if search_s < target_s else 'MISSED'})")
        print(f"  candidates {solver['num_candidates']}: solved {solver['num_solved']}, pruned by bound "
              f"{solver['num_pruned_bound']}, by memory {solver['num_pruned_memory']}, cut off in the ILP "
              f"{solver['num_cutoff']}, infeasible {solver['num_infeasible']}")
        print(f"  winner ILP: {solver['backend']} {solver['status']}, gap {100 * solver['gap']:.3f}% "
              f"({solver['formulation']}); largest gap among re-ranked candidates {100 * solver['max_gap']:.2f}%")
        sched = cfg.schedule + (f" x{cfg.virtual_stages}" if cfg.schedule == "interleaved" else "")
        print(f"  winner: tp {cfg.tp} pp {cfg.pp} dp {cfg.dp}{' sp' if cfg.sp else ''}, {sched}, mbs "
              f"{cfg.microbatch_size} (m = {cfg.num_microbatches}), ZeRO-{cfg.zero}, recompute "
              f"{sum(layer.recompute != 'none' for layer in result.layers)} of {len(result.layers)} layers")
        print(f"  simulated step {pred['step_time_s']:.3f} s, MFU {100 * pred['mfu']:.1f}%, peak "
              f"{pred['peak_memory_bytes'] / 2**30:.1f} GiB, ILP objective {solver['ilp_objective_s']:.3f} s")


if __name__ == "__main__":
    main()
