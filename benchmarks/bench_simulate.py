"""How fast the step simulator is: Llama-3 70B, p = 16, m = 128 on 1024 GPUs, and growth with p * m.

Run: python benchmarks/bench_simulate.py [--cluster h100-sxm] [--model llama3-70b] [--seq 4096]

Prints the in-process time of `simulate_config` (cost model + event engine, without and with the
timeline), the whole `meshplan simulate --plan plan.json` command time (a fresh process that
also imports torch and profiles the model on the meta device), and the engine's time per action
as p * m grows (a well-behaved simulator stays linear: constant time per action).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _best_of(repeats: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="h100-sxm")
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()

    from meshplan.planner.costing import uniform
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.contracts.plan import LayerAssignment, ModelRef, Plan, save_plan
    from meshplan.planner.profiling.profiler import profile
    from meshplan.planner.simulation.simulator import simulate_config, step_costs
    from meshplan.planner.simulation.event_engine import simulate_step

    cluster = load_cluster(args.cluster)
    start = time.perf_counter()
    graph = profile(args.model, args.seq, dtype="bf16", attention="flash")
    print(f"profiled {args.model} (seq {args.seq}, {len(graph.layers)} layers) in {time.perf_counter() - start:.2f} s")

    # Megatron-style 70B layout: tp 8 inside a node, pp 16, dp 8; 128 micro-batches of 1.
    cfg = ParallelConfig(gpus=1024, global_batch=1024, tp=8, pp=16, dp=8, microbatch_size=1, zero=1,
                         recompute="selective", sp=True)
    chunks = uniform.balanced_layer_chunks(graph, cluster, cfg)
    elapsed, pred = _best_of(5, lambda: simulate_config(graph, cluster, cfg, chunk_of_layer=chunks))
    print(f"\n70B p={cfg.pp} m={cfg.num_microbatches} on {cfg.gpus} GPUs ({args.cluster}):")
    print(f"  in-process simulate_config, no timeline:  {elapsed * 1e3:8.1f} ms  (target < 1000 ms)")
    elapsed_tl, pred_tl = _best_of(3, lambda: simulate_config(graph, cluster, cfg, chunk_of_layer=chunks, timeline=True))
    print(f"  in-process simulate_config, with timeline: {elapsed_tl * 1e3:8.1f} ms  ({len(pred_tl.timeline)} intervals)")
    print(f"  predicted step {pred.step_time_s:.3f} s, bubble {pred.bubble_fraction:.1%}, MFU {pred.mfu:.1%}, "
          f"peak memory {pred.peak_memory_bytes / 2**30:.1f} GiB, fits {pred.fits}")

    layers = tuple(LayerAssignment(name=layer.name, stage=c % cfg.pp, virtual_stage=c // cfg.pp, tp=cfg.tp, dp=cfg.dp,
                                   recompute="selective" if layer.kind == "block" else "none")
                   for layer, c in zip(graph.layers, chunks))
    plan = Plan(model=ModelRef(spec=args.model, seq=args.seq), cluster=cluster, config=cfg, layers=layers)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        save_plan(plan, plan_path)
        command = [sys.executable, "-m", "meshplan.cli", "simulate", "--plan", str(plan_path), "--json"]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        whole = time.perf_counter() - start
        command += ["--trace", str(Path(tmp) / "trace.json")]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        whole_trace = time.perf_counter() - start
    print(f"  whole command `meshplan simulate --plan plan.json --json`: {whole:.2f} s "
          f"(with --trace: {whole_trace:.2f} s; includes interpreter start, torch import, profiling)")

    print("\nengine time vs p*m (70B costs, 1F1B; interleaved v=2 in brackets):")
    print(f"  {'p':>3} {'m':>5} {'p*m':>7} {'engine ms':>10} {'us/action':>10} {'[v=2 ms]':>9}")
    for pp, num_mb in ((4, 32), (8, 64), (16, 128), (16, 512), (32, 512), (64, 512), (64, 2048)):
        dp = max(1, 1024 // (8 * pp))
        grid = ParallelConfig(gpus=8 * pp * dp, global_batch=num_mb * dp, tp=8, pp=pp, dp=dp, zero=1,
                              recompute="selective", sp=True)
        costs = step_costs(graph, cluster, grid, chunk_of_layer=uniform.balanced_layer_chunks(graph, cluster, grid))
        elapsed, _ = _best_of(3, lambda: simulate_step(costs))
        interleaved = "-"
        if 2 * pp <= len(graph.layers):  # every chunk needs a layer
            inter = ParallelConfig(**{**grid.to_json(), "schedule": "interleaved", "virtual_stages": 2})
            inter_costs = step_costs(graph, cluster, inter,
                                     chunk_of_layer=uniform.balanced_layer_chunks(graph, cluster, inter))
            interleaved = f"{_best_of(3, lambda: simulate_step(inter_costs))[0] * 1e3:.1f}"
        actions = 2 * pp * num_mb
        print(f"  {pp:>3} {num_mb:>5} {pp * num_mb:>7} {elapsed * 1e3:>10.1f} {elapsed / actions * 1e6:>10.2f} "
              f"{interleaved:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
