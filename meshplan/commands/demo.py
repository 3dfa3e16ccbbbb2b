"""`meshplan demo`: calibrate, profile, plan, train and report on this machine, then plan a large model."""
from __future__ import annotations

from pathlib import Path


def add_arguments(parser):
    parser.add_argument("--out-dir", default="demo-out", help="where the demo writes its files (default demo-out)")
    parser.add_argument("--steps", type=int, default=12, help="training steps of the local run (default 12)")


def run(args) -> int:
    from meshplan.demo import DemoConfig, run_demo

    result = run_demo(DemoConfig(out_dir=Path(args.out_dir), train_steps=args.steps))
    print("")
    print(f"meshplan demo finished in {result.step_times_s['total']:.0f} s. Open the reports in a browser:")
    print(f"  local 2-process run, predicted vs measured: {result.small_report.resolve()}")
    print(f"  llama3-70b on 64 x H100:                    {result.large_report.resolve()}")
    return 0
