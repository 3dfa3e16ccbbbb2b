"""Predicted against measured on one CUDA GPU: GEMMs by shape, fused attention by kernel and
sequence length, fp8 GEMMs (rowwise scaling too, at TP 8 shard shapes), Llama 3.1 70B and 8B TP 8
shards' Linears under torchao's Float8 (`fp8_block_check.py`), torchtitan's loss's peak memory and time
eager, under loss_parallel and compiled (`loss_memory_check.py`), the memory bandwidth, `calibrate --nproc 1`, and whole training
steps (time and peak memory) planned by `meshplan plan` and run by `meshplan train`, each step
then profiled (`gpu_step_profile.py`: device busy time, kernels, host operators, FSDP2 hooks).

    python benchmarks/gpu_check.py [--cluster h200] [--out DIR] [--skip-train | --train-only] [--cases A,B]
        [--sections copy,gemm,attention,fp8,fp8_rowwise,fp8_block,loss_memory,calibrate] [--steps 12]

Nothing measured here is fitted to: every prediction comes from the shipped profile (`--cluster`,
default the one whose device name matches this GPU), so each figure is held out. Results are
printed and written, section by section, to DIR/gpu_check.json. Without a CUDA device it stops
in one line (exit 2).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fp8_block_check import check_fp8_block  # siblings in benchmarks/
from loss_memory_check import check_loss_memory

# Transformer Linears (column: split on the output under TP), forward and both gradient GEMMs:
# hidden sizes of small to large models, 2K and 8K tokens a micro-batch, no TP and a 4-way shard.
HIDDENS = (1024, 2048, 4096, 8192)
TOKENS = (2048, 8192)
TPS = (1, 4)
ATTENTION_SEQS = (1024, 2048, 4096, 8192, 16384)
ATTENTION_TOKENS = 32768  # batch x seq per timed call
FP8_SHAPES = ((8192, 8192, 8192), (8192, 4096, 16384), (16384, 8192, 4096), (4096, 1024, 4096))
# Llama 3.1 8B and 70B at TP 8 as torchtitan's async-TP table ran them (local batch 12 and 16 of
# 8,192 tokens, one micro-batch): (name, rows, hidden, KV width, FFN width) for `fp8_tp8_gemms`.
ROWWISE_MODELS = (("llama3-8b tp8", 12 * 8192, 4096, 1024, 14336), ("llama3-70b tp8", 16 * 8192, 8192, 1024, 28672))
# (name, model, seq, global batch, extra plan flags): a GPT-2-XL-sized model at the planner's
# choice and under gradient accumulation (the same 16 samples in 1, 4 and 8 micro-batches: what a
# micro-batch costs beyond its FLOPs, `per_microbatch`), and a Llama-3-8B-shaped model of 16 layers.
TRAIN_CASES = (
    ("gpt-1.3b", "gpt:layers=24,hidden=2048,heads=16,vocab=50304", 2048, 16, ()),
    ("gpt-1.3b-mbs4", "gpt:layers=24,hidden=2048,heads=16,vocab=50304", 2048, 16, ("--mbs", "4")),
    ("gpt-1.3b-mbs2", "gpt:layers=24,hidden=2048,heads=16,vocab=50304", 2048, 16, ("--mbs", "2")),
    ("llama-4.5b", "llama:layers=16,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256", 4096, 8, ()),
)


def _timed(torch, fn, target_s: float = 2e-3, samples: int = 5) -> float:
    """Seconds of one `fn()`'s kernels: back-to-back calls between CUDA events (enough for
    `target_s`) queued behind a spin kernel that outlasts their launching (`fill_queue`), the
    median of `samples` such timings after a warm-up."""
    from meshplan.planner.calibration.compute_bench import fill_queue

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_s = time.perf_counter() - begin
    torch.cuda.synchronize()
    inner = max(1, min(200, math.ceil(target_s / max(start.elapsed_time(end) / 1e3, 1e-7))))
    times = []
    for _ in range(samples):
        fill_queue(torch, host_s * inner)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def _summary(rows: list[dict], predicted: str = "predicted_s") -> dict:
    """Mean |error|, its signed mean, and the spread once the level is taken out (the geometric
    mean ratio divided away): what the shape model explains, beside a constant rate's spread."""
    ratios = [r[predicted] / r["measured_s"] for r in rows]
    level = math.exp(statistics.fmean(math.log(x) for x in ratios))
    out = {"runs": len(rows), "mean_abs_error": statistics.fmean(abs(x - 1) for x in ratios),
           "mean_signed_error": statistics.fmean(x - 1 for x in ratios), "level": level,
           "shape_error_after_level": statistics.fmean(abs(x / level - 1) for x in ratios)}
    if "flops" in rows[0]:  # a constant rate: time = flops / R, R the geometric best fit
        rates = [r["flops"] / r["measured_s"] for r in rows]
        best = math.exp(statistics.fmean(math.log(x) for x in rates))
        out["constant_rate_error"] = statistics.fmean(abs(rate / best - 1) for rate in rates)
    return out


def gemm_shapes() -> list[tuple[int, int, int]]:
    shapes = set()
    for hidden in HIDDENS:
        for tokens in TOKENS:
            for tp in TPS:
                for in_dim, out_dim, column in ((hidden, 3 * hidden, True), (hidden, hidden, False),
                                                (hidden, 4 * hidden, True), (4 * hidden, hidden, False)):
                    i, o = (in_dim, out_dim // tp) if column else (in_dim // tp, out_dim)
                    shapes |= {(tokens, o, i), (tokens, i, o), (i, o, tokens)}  # forward, input and weight grads
    return sorted(shapes, key=lambda s: s[0] * s[1] * s[2])


def check_gemms(torch, clusters: dict) -> dict:
    from meshplan.planner.costing.gemm import gemm_time_s

    rows = []
    for m, n, k in gemm_shapes():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        row = {"m": m, "n": n, "k": k, "flops": 2.0 * m * n * k, "measured_s": _timed(torch, lambda: torch.mm(a, b))}
        for name, cluster in clusters.items():
            row[f"predicted_s[{name}]"] = gemm_time_s(m, n, k, cluster, "bf16")
        rows.append(row)
    out = {"rows": rows}
    for name in clusters:
        out[name] = _summary(rows, f"predicted_s[{name}]")
        small = [r for r in rows if min(r["m"], r["n"], r["k"]) <= 1024]
        out[f"{name} narrowest <= 1024"] = _summary(small, f"predicted_s[{name}]") if small else {}
    return out


def check_attention(torch, clusters: dict) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from meshplan.planner.costing.attention_kernels import attention_efficiency

    backends = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-mem-efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    rows, failed = [], {}
    for kernel, backend in backends.items():
        for head_dim in (64, 128):
            heads = 2048 // head_dim
            for seq in ATTENTION_SEQS:
                batch = max(1, ATTENTION_TOKENS // seq)
                q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))

                def step():
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(torch.ones_like(q))
                try:
                    seconds = _timed(torch, step, target_s=5e-3, samples=3)
                except RuntimeError as exc:  # a backend this build or shape lacks
                    failed[kernel] = str(exc).splitlines()[0][:160]
                    break
                flops = 3 * 4.0 * batch * heads * seq * seq * head_dim / 2  # causal half; backward 2x (meshplan)
                row = {"kernel": kernel, "seq": seq, "head_dim": head_dim, "flops": flops, "measured_s": seconds}
                for name, cluster in clusters.items():
                    efficiency = attention_efficiency(kernel, cluster, seq, head_dim)
                    row[f"predicted_s[{name}]"] = flops / (cluster.device.peak_flops("bf16") * efficiency)
                rows.append(row)
    out = {"rows": rows, "failed": failed}
    for kernel in backends:
        mine = [r for r in rows if r["kernel"] == kernel]
        for name in clusters:
            if mine:
                out[f"{kernel} {name}"] = _summary(mine, f"predicted_s[{name}]")
    return out


def check_fp8(torch, clusters: dict) -> dict:
    from meshplan.planner.costing.gemm import gemm_time_s

    if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability() < (8, 9):
        return {"skipped": "fp8 GEMMs need torch._scaled_mm on compute capability 8.9 or newer"}
    rows = []
    one = torch.ones((), device="cuda", dtype=torch.float32)
    for m, n, k in FP8_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major, as cuBLASLt wants
        bf16_s = _timed(torch, lambda: torch.mm(a, b.t()))
        fp8_s = _timed(torch, lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
        row = {"m": m, "n": n, "k": k, "bf16_s": bf16_s, "fp8_s": fp8_s, "measured_speedup": bf16_s / fp8_s}
        for name, cluster in clusters.items():
            row[f"predicted_speedup[{name}]"] = (gemm_time_s(m, n, k, cluster, "bf16")
                                                 / gemm_time_s(m, n, k, cluster, "fp8"))
        rows.append(row)
    return {"rows": rows}


def fp8_tp8_gemms(models=ROWWISE_MODELS, tp: int = 8) -> list[tuple[str, str, str, int, int, int]]:
    """(model, Linear, GEMM, m, n, k) of every Linear's three GEMMs on one TP shard (column Linears
    split on their output, row Linears on their input): the shapes torchao's Float8 recipes run
    under torchtitan's TP, wk and wv's 128 columns among them."""
    out = []
    for model, rows, hidden, kv, ffn in models:
        linears = (("wq", hidden, hidden // tp), ("wk", hidden, kv // tp), ("wv", hidden, kv // tp),
                   ("wo", hidden // tp, hidden), ("w1", hidden, ffn // tp), ("w3", hidden, ffn // tp),
                   ("w2", ffn // tp, hidden))
        for name, in_dim, out_dim in linears:
            out += [(model, name, "forward", rows, out_dim, in_dim), (model, name, "input gradient", rows, in_dim, out_dim),
                    (model, name, "weight gradient", in_dim, out_dim, rows)]
    return out


def check_fp8_rowwise(torch, clusters: dict, device: str = "cuda", gemms=None, timed=None) -> dict:
    """torch's fp8 GEMM kernels at TP 8 shard shapes: bf16, tensorwise scaling with and without fast
    accumulation (cuBLAS) and rowwise scaling with it (a CUTLASS kernel), beside meshplan's fp8 and
    bf16 prices, which give every fp8 kernel one rate. Per model, the GEMM seconds of one
    micro-batch under each torchao recipe as it runs them (forward with fast accumulation, both
    gradients without: rowwise's on the tensorwise kernel, `fp8.gradient_rescale_s`), to tell
    whether rowwise's kernels explain torchtitan's rowwise TP 8 runs being slower than predicted."""
    from meshplan.planner.costing.gemm import gemm_time_s

    timed = timed or (lambda fn: _timed(torch, fn))
    one = torch.ones((), device=device, dtype=torch.float32)  # a tensorwise scale
    rows = []
    for model, linear, kind, m, n, k in gemms or fp8_tp8_gemms():
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major, as the kernels want
        row_a, row_b = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
        row = {"model": model, "linear": linear, "gemm": kind, "m": m, "n": n, "k": k,
               "bf16_s": timed(lambda: torch.mm(a, b.t())),
               "tensorwise_s": timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16,
                                                              use_fast_accum=True)),
               "tensorwise_slow_accum_s": timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)),
               "rowwise_s": timed(lambda: torch._scaled_mm(a8, b8, row_a, row_b, out_dtype=torch.bfloat16,
                                                           use_fast_accum=True))}
        for name, cluster in clusters.items():
            row[f"predicted_bf16_s[{name}]"] = gemm_time_s(m, n, k, cluster, "bf16")
            row[f"predicted_fp8_s[{name}]"] = gemm_time_s(m, n, k, cluster, "fp8")
        rows.append(row)
        del a, b, a8, b8
    out: dict = {"rows": rows}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        grads = [r for r in mine if r["gemm"] != "forward"]
        forward = [r for r in mine if r["gemm"] == "forward"]
        out[model] = {"bf16_s": sum(r["bf16_s"] for r in mine),
                      "tensorwise_recipe_s": sum(r["tensorwise_s"] for r in forward)
                      + sum(r["tensorwise_slow_accum_s"] for r in grads),
                      "rowwise_recipe_s": sum(r["rowwise_s"] for r in forward)
                      + sum(r["tensorwise_slow_accum_s"] for r in grads),
                      **{key: sum(r[key] for r in mine) for key in mine[0] if key.startswith("predicted_")}}
    return out


def check_copy(torch, clusters: dict) -> dict:
    src = torch.ones(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    seconds = _timed(torch, lambda: dst.copy_(src), target_s=2e-2)
    measured = 2 * src.numel() * 4 / seconds
    return {"measured_bytes_per_s": measured,
            **{f"profile_bytes_per_s[{name}]": c.device.memory_bw_bytes_per_s * c.device.memory_efficiency
               for name, c in clusters.items()}}


# The kernel sections in the order they run (`--sections`); calibrate runs `meshplan calibrate`.
KERNEL_SECTIONS = {"copy": check_copy, "gemm": check_gemms, "attention": check_attention, "fp8": check_fp8,
                   "fp8_rowwise": check_fp8_rowwise,
                   "fp8_block": lambda torch, clusters: check_fp8_block(torch, clusters, lambda fn: _timed(torch, fn)),
                   "loss_memory": lambda torch, clusters: check_loss_memory(torch, clusters,
                                                                            timer=lambda fn: _timed(torch, fn)),
                   "calibrate": None}


def _meshplan(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    # Run from outside the checkout: there, the repository's own `meshplan/` folder (the CLI
    # alone) would shadow an installed meshplan and its planner. Every path passed is absolute.
    return subprocess.run([sys.executable, "-m", "meshplan.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=tempfile.gettempdir())


def run_calibrate(out_dir: Path) -> dict:
    path = out_dir / "calibrated-one-gpu.toml"
    started = time.perf_counter()
    done = _meshplan("calibrate", "--nproc", "1", "--out", str(path))
    result = {"rc": done.returncode, "seconds": time.perf_counter() - started, "stdout": done.stdout[-3000:],
              "stderr": done.stderr[-3000:]}
    if done.returncode == 0:
        result["profile"] = str(path)
    return result


def run_train(case, clusters: dict, work: Path, steps: int) -> dict:
    """Plan `case` on each profile, train the first profile's plan, and set every prediction beside it."""
    name, model, seq, gbs, flags = case
    result = {"model": model, "seq": seq, "gbs": gbs, "flags": list(flags), "predictions": {}}
    plan_path = None
    for label, cluster in clusters.items():
        path = work / f"{name}-{label}.json"
        done = _meshplan("plan", "--model", model, "--cluster", cluster, "--gpus", "1", "--gbs", str(gbs),
                         "--seq", str(seq), *flags, "--out", str(path))
        if done.returncode != 0:
            result["predictions"][label] = {"error": (done.stderr or done.stdout)[-800:]}
            continue
        plan = json.loads(path.read_text())
        result["predictions"][label] = {**{k: plan["prediction"][k] for k in ("step_time_s", "peak_memory_bytes", "mfu")},
                                        "microbatch_size": plan["schedule"]["microbatch_size"],
                                        "recompute": plan["recompute"]}
        plan_path = plan_path or path
    if plan_path is None:
        return result
    measured_path = work / f"{name}-measured.json"
    done = _meshplan("train", "--plan", str(plan_path), "--steps", str(steps), "--out", str(measured_path))
    result["train_rc"] = done.returncode
    if done.returncode != 0:
        result["train_error"] = (done.stderr or done.stdout)[-1500:]
        return result
    measured = json.loads(measured_path.read_text())
    times = measured["step_times_s"][measured["warmup_steps"]:]
    result["measured"] = {"step_time_s": statistics.median(times), "step_times_s": measured["step_times_s"],
                          "peak_memory_bytes": max(measured["peak_memory_bytes_per_rank"]),
                          "final_loss": measured["losses"][-1]}
    for label, prediction in result["predictions"].items():
        if "step_time_s" in prediction:
            prediction["time_error"] = prediction["step_time_s"] / result["measured"]["step_time_s"] - 1
            prediction["memory_error"] = prediction["peak_memory_bytes"] / result["measured"]["peak_memory_bytes"] - 1
    result["step_profile"] = step_profile(plan_path)
    return result


def step_profile(plan_path: Path) -> dict:
    """Where the trained plan's step spends its time (`gpu_step_profile.py`, in a fresh process)."""
    script = Path(__file__).resolve().with_name("gpu_step_profile.py")
    done = subprocess.run([sys.executable, str(script), str(plan_path)], capture_output=True, text=True,
                          timeout=600, cwd=tempfile.gettempdir())
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"rc": done.returncode, "error": (done.stderr or done.stdout)[-1500:]}
    return json.loads(lines[-1])


def per_microbatch(runs: dict) -> dict:
    """The step time each extra micro-batch adds, measured and predicted, from the GPT cases that
    split the same samples into more micro-batches (least squares on their micro-batch counts)."""
    points = []
    for run in runs.values():
        if run.get("model", "").startswith("gpt:") and "measured" in run:
            predicted = next(iter(run["predictions"].values()))
            count = run["gbs"] // predicted["microbatch_size"]
            points.append((count, run["measured"]["step_time_s"], predicted["step_time_s"]))
    if len({count for count, _, _ in points}) < 2:
        return {}

    def slope(values):
        mean_x = statistics.fmean(c for c, _ in values)
        mean_y = statistics.fmean(y for _, y in values)
        return (sum((c - mean_x) * (y - mean_y) for c, y in values)
                / sum((c - mean_x) ** 2 for c, _ in values))
    return {"measured_s": slope([(c, m) for c, m, _ in points]), "predicted_s": slope([(c, p) for c, _, p in points]),
            "microbatch_counts": sorted(c for c, _, _ in points)}


def _rescored(rows: list[dict], cluster) -> dict:
    """The GEMM sweep's errors under another profile (the one `calibrate` just measured)."""
    from meshplan.planner.costing.gemm import gemm_time_s

    return _summary([{**r, "predicted_s": gemm_time_s(r["m"], r["n"], r["k"], cluster, "bf16")} for r in rows])


def _print_section(title: str, value) -> None:
    print(f"== {title}", flush=True)
    if isinstance(value, dict):
        for key, item in value.items():
            if key != "rows":
                print(f"  {key}: {json.dumps(item, default=str)[:600]}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=None, help="shipped profile to predict with (default: this GPU's)")
    parser.add_argument("--out", default="gpu-check", help="directory for the JSON, plans and measurements")
    parser.add_argument("--steps", type=int, default=12, help="training steps per case")
    parser.add_argument("--skip-train", action="store_true", help="the kernel checks only")
    parser.add_argument("--train-only", action="store_true", help="the training cases only (no kernels, no calibrate)")
    parser.add_argument("--cases", default=",".join(case[0] for case in TRAIN_CASES),
                        help="comma-separated training cases to run (default: all)")
    parser.add_argument("--sections", default=",".join(KERNEL_SECTIONS),
                        help=f"comma-separated kernel sections to run, of {', '.join(KERNEL_SECTIONS)} (default: all)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; it times GEMMs, attention and training steps on one GPU",
              file=sys.stderr)
        return 2
    from meshplan.planner.calibration.runner import base_profile_for
    from meshplan.planner.costing.hardware import load_cluster

    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    shipped = load_cluster(args.cluster) if args.cluster else base_profile_for(None, "nccl", props.name)
    report = {"device": props.name, "sms": props.multi_processor_count, "memory_bytes": props.total_memory,
              "torch": torch.__version__, "cuda": torch.version.cuda, "profile": shipped.name}
    _print_section("device", report)
    clusters = {shipped.name: shipped}

    def record(key, fn, *fn_args):
        started = time.perf_counter()
        try:
            report[key] = fn(*fn_args)
        except Exception as exc:  # one failed section must not cost the others
            report[key] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        report[key + "_seconds"] = time.perf_counter() - started
        _print_section(key, report[key])
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))

    cases = [case for case in TRAIN_CASES if case[0] in args.cases.split(",")]
    sections = [name for name in KERNEL_SECTIONS if name in args.sections.split(",")] if not args.train_only else []
    for name in sections:
        if name == "calibrate":
            torch.cuda.empty_cache()
            record(name, run_calibrate, out_dir)
        else:
            record(name, KERNEL_SECTIONS[name], torch, clusters)
    profiles = {shipped.name: shipped.name}
    if report.get("calibrate", {}).get("profile"):
        profiles["calibrated"] = report["calibrate"]["profile"]
        if "gemm" in report:  # the GEMMs timed above, priced by the calibrated profile
            record("gemm_calibrated", _rescored, report["gemm"].get("rows", []),
                   load_cluster(report["calibrate"]["profile"]))
    if not args.skip_train:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:  # plans stay out of DIR
            for case in cases:
                record(f"train {case[0]}", run_train, case, profiles, Path(work), args.steps)
        record("per_microbatch", per_microbatch,
               {k: v for k, v in report.items() if k.startswith("train ") and isinstance(v, dict)})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
