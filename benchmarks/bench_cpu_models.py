"""Predicted vs measured step time and memory off the GPT path: a CNN, a UNet-like model and a
Hugging Face decoder, each on 2 local CPU processes (gloo), after `meshplan calibrate`.

    python benchmarks/bench_cpu_models.py [--profile cpu.toml] [--steps 8] [--repeats 2]

`calibrate` fits its constants on GPT blocks of hidden 256 (`planner.calibration`); none of the
models here is one, so every row is held out. Models: `benchmarks/models/cnn.py` (a ResNet with
batch norm, 3x64x64 images), `benchmarks/models/unet.py` (conv + group norm + SiLU encoder/decoder
with skips and transposed convolutions), `benchmarks/models/hf_llama_tiny.json` (a 4-layer
Llama config built by transformers). The GPT of the calibration is run first as the in-sample
reference. Each row prints the predicted and measured step time (the median of the timed steps,
the least disturbed of `--repeats` runs) and the predicted and measured peak memory per rank
(`MemTracker` live tensor bytes), against the 20% target.

Other jobs on a shared machine slow the measured step but not the prediction: the load average
is printed with every row, and `--probe` also prints the share of one core a 512x512 matmul
loop got just before the row ran.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_pred_vs_measured import MODEL as FIT_MODEL, SEQ as FIT_SEQ, calibrate, run_config  # noqa: E402

TARGET = 0.20
MODELS = Path(__file__).parent / "models"
GLOBAL_BATCH = 8
# (name, spec, seq, pins): seq is ignored by file models (their shapes come from the example inputs)
ROWS = (
    ("GPT-fit", FIT_MODEL, FIT_SEQ, dict(dp=2, tp=1, pp=1, zero=0)),
    ("CNN-DP", f"{MODELS / 'cnn.py'}:build", 1, dict(dp=2, tp=1, pp=1, zero=0)),
    ("UNet-DP", f"{MODELS / 'unet.py'}:build", 1, dict(dp=2, tp=1, pp=1, zero=0)),
    ("HF-DP", f"hf:{MODELS / 'hf_llama_tiny.json'}", 128, dict(dp=2, tp=1, pp=1, zero=0)),
    ("HF-ZeRO3", f"hf:{MODELS / 'hf_llama_tiny.json'}", 128, dict(dp=2, tp=1, pp=1, zero=3)),
)


def core_share(seconds: float = 0.3) -> float:
    """The share of one core a single-threaded 512x512 matmul loop gets now (1.0: an idle core),
    against the best of three tries."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    rates = []
    for _ in range(3):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            a @ b
            count += 1
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates) / max(rates)


def idle_fraction(interval_s: float = 0.5) -> float:
    """The machine's idle CPU share over `interval_s` (Linux /proc/stat; 1.0 where it cannot tell)."""
    def counters():
        fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    try:
        idle0, total0 = counters()
        time.sleep(interval_s)
        idle1, total1 = counters()
    except (OSError, ValueError, IndexError):
        return 1.0
    return (idle1 - idle0) / max(total1 - total0, 1e-9)


def wait_for_idle(threshold: float, timeout_s: float) -> float:
    """Wait (at most `timeout_s`) until the machine is at least `threshold` idle; return the
    seconds waited. A row measured on a busy machine measures the other jobs."""
    start = time.perf_counter()
    while idle_fraction() < threshold and time.perf_counter() - start < timeout_s:
        time.sleep(1.0)
    return time.perf_counter() - start


def run_row(row, profile: Path, work: Path, steps: int, probe: bool, idle: float = 0.0) -> dict:
    from meshplan.planner.contracts.plan import load_plan

    name, spec, seq, pins = row
    if idle:
        wait_for_idle(idle, timeout_s=120)
    share = core_share() if probe else None
    result = run_config(name, pins, 2, profile, work, steps, model=spec, seq=seq, global_batch=GLOBAL_BATCH)
    plan = load_plan(work / f"plan-{name}.json")
    measured = json.loads((work / f"measured-{name}.json").read_text())
    result.update(predicted_mem=plan.prediction["peak_memory_bytes"],
                  measured_mem=max(measured["peak_memory_bytes_per_rank"]), share=share)
    result["mem_error"] = (result["predicted_mem"] - result["measured_mem"]) / result["measured_mem"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, help="a 2-process calibrated profile (default: calibrate now)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per configuration")
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration; the least disturbed is kept")
    parser.add_argument("--probe", action="store_true", help="also print each row's core share before it ran")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="F",
                        help="before each row, wait (up to 2 min) until the machine is at least F idle (e.g. 0.9)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="meshplan-models-") as tmp:
        work = Path(tmp)
        if not args.profile and args.wait_idle:
            wait_for_idle(args.wait_idle, timeout_s=120)
        profile = args.profile or calibrate(work / "cpu-calibrated.toml", 2)
        if not args.profile:
            shutil.copy(profile, Path(tempfile.gettempdir()) / "meshplan-cpu-calibrated.toml")  # to reuse with --profile
        start_s = time.perf_counter()
        print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
        runs: dict[str, list[dict]] = {row[0]: [] for row in ROWS}
        for _ in range(args.repeats):
            for row in ROWS:
                result = run_row(row, profile, work, args.steps, args.probe, args.wait_idle)
                runs[row[0]].append(result)
                print(f"  {row[0]}: {result['measured_s'] * 1e3:.1f} ms measured, {result['predicted_s'] * 1e3:.1f} "
                      f"ms predicted (load {result['load']:.1f})", flush=True)
        best = [min(runs[row[0]], key=lambda r: r["measured_s"]) for row in ROWS]
        print(f"\n{'config':<9} {'mesh':<22} {'pred ms':>8} {'meas ms':>8} {'error':>7}   {'pred MiB':>8} "
              f"{'meas MiB':>8} {'error':>7} {'load':>5}" + (f" {'share':>5}" if args.probe else ""))
        for r in best:
            flag = "ok" if abs(r["error"]) <= TARGET and abs(r["mem_error"]) <= TARGET else "OVER 20%"
            print(f"{r['name']:<9} {r['mesh']:<22} {r['predicted_s'] * 1e3:>8.1f} {r['measured_s'] * 1e3:>8.1f} "
                  f"{r['error']:>+7.1%}   {r['predicted_mem'] / 2**20:>8.1f} {r['measured_mem'] / 2**20:>8.1f} "
                  f"{r['mem_error']:>+7.1%} {r['load']:>5.1f}" + (f" {r['share']:>5.2f}" if args.probe else "")
                  + f"  {flag}")
        held = best[1:]
        print(f"\nfit shape (in-sample): step {best[0]['error']:+.1%}, memory {best[0]['mem_error']:+.1%}")
        print(f"held out ({len(held)} rows): step mean |error| {statistics.mean(abs(r['error']) for r in held):.1%}, "
              f"max {max(abs(r['error']) for r in held):.1%}; memory mean |error| "
              f"{statistics.mean(abs(r['mem_error']) for r in held):.1%}, max "
              f"{max(abs(r['mem_error']) for r in held):.1%} (target {TARGET:.0%} each)")
        print(f"benchmark took {time.perf_counter() - start_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
