"""`meshplan demo`: the whole loop on this machine, then a large model on a simulated cluster.

1. calibrate the local CPU processes (2 gloo processes) into a cluster profile;
2. profile a small GPT on the meta device;
3. plan it for 2 local processes on the calibrated profile;
4. train the plan for real (`meshplan train`, a few steps) and record measured.json;
5. write report.html comparing predicted and measured;
6. plan llama3-70b on a 64-GPU H100 profile and write its report.

Every step goes through the same public entry points a user types (`meshplan.cli.main`), so the
demo exercises exactly what the README documents. A failing step stops the demo with its name.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from meshplan.planner.contracts.errors import MeshplanError

CliMain = Callable[[list[str]], int]


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs. Defaults keep the whole demo under 5 minutes on a 2-core laptop."""

    out_dir: Path = Path("demo-out")
    # A small GPT: big enough that compute (not only fixed per-op costs) shows, small enough
    # that a training step takes a fraction of a second on one CPU core.
    small_model: str = "gpt:layers=4,hidden=256,heads=4,vocab=4096"
    small_seq: int = 128
    small_global_batch: int = 8
    num_local_processes: int = 2
    train_steps: int = 12
    large_model: str = "llama3-70b"
    large_cluster: str = "h100-sxm"
    large_gpus: int = 64
    large_global_batch: int = 256
    large_seq: int = 4096
    calibrate_args: tuple[str, ...] = ("--quick",)  # a rough profile in seconds, enough for the demo

    def __post_init__(self):
        for name in ("small_seq", "small_global_batch", "num_local_processes", "train_steps", "large_gpus",
                     "large_global_batch", "large_seq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"demo {name} must be positive, got {getattr(self, name)}")


@dataclass
class DemoResult:
    """Where the demo wrote things and how long each step took."""

    small_report: Path | None = None
    large_report: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)
    step_times_s: dict[str, float] = field(default_factory=dict)


def _run_step(name: str, argv: Sequence[str], cli_main: CliMain, result: DemoResult, say) -> None:
    argv = [str(a) for a in argv]
    say(f"[demo] {name}: meshplan {' '.join(argv)}")
    start_s = time.perf_counter()
    code = cli_main(argv)
    result.step_times_s[name] = time.perf_counter() - start_s
    if code != 0:
        raise MeshplanError(f"demo step '{name}' failed (exit {code}); the message above says why")
    say(f"[demo] {name}: done in {result.step_times_s[name]:.1f} s")


def _report(name: str, plan_path: Path, measured: Sequence[Path], out: Path, result: DemoResult, say) -> Path:
    from meshplan.reports import write_report

    start_s = time.perf_counter()
    write_report(plan_path, measurements=list(measured), out=out)
    result.step_times_s[name] = time.perf_counter() - start_s
    say(f"[demo] {name}: wrote {out} in {result.step_times_s[name]:.1f} s")
    return out


def run_local_loop(config: DemoConfig, cli_main: CliMain, result: DemoResult, say=print) -> Path:
    """Steps 1-5: calibrate, profile, plan, train and report the small GPT on local processes."""
    local = config.out_dir / "local"
    local.mkdir(parents=True, exist_ok=True)
    profile_path, plan_path = local / "cpu-calibrated.toml", local / "plan.json"
    measured_path = local / "measured.json"
    nproc = str(config.num_local_processes)
    _run_step("calibrate", ["calibrate", "--nproc", nproc, "--backend", "gloo", "--out", profile_path,
                            *config.calibrate_args], cli_main, result, say)
    _run_step("profile", ["profile", "--model", config.small_model, "--seq", config.small_seq, "--dtype", "fp32"],
              cli_main, result, say)
    _run_step("plan", ["plan", "--model", config.small_model, "--cluster", profile_path, "--gpus", nproc,
                       "--gbs", config.small_global_batch, "--seq", config.small_seq, "--out", plan_path],
              cli_main, result, say)
    _run_step("train", ["train", "--plan", plan_path, "--nproc", nproc, "--steps", config.train_steps,
                        "--out", measured_path], cli_main, result, say)
    result.files.update(profile=profile_path, small_plan=plan_path, measured=measured_path)
    return _report("report (local)", plan_path, [measured_path], local / "report.html", result, say)


def run_large_plan(config: DemoConfig, cli_main: CliMain, result: DemoResult, say=print) -> Path:
    """Step 6: plan the large model on the simulated GPU cluster and report it."""
    large = config.out_dir / config.large_model.replace("/", "_").replace(":", "_")
    large.mkdir(parents=True, exist_ok=True)
    plan_path = large / "plan.json"
    _run_step(f"plan {config.large_model}", ["plan", "--model", config.large_model, "--cluster", config.large_cluster,
                                             "--gpus", config.large_gpus, "--gbs", config.large_global_batch,
                                             "--seq", config.large_seq, "--out", plan_path], cli_main, result, say)
    result.files["large_plan"] = plan_path
    return _report(f"report ({config.large_model})", plan_path, [], large / "report.html", result, say)


def run_demo(config: DemoConfig = DemoConfig(), cli_main: CliMain | None = None, say=print) -> DemoResult:
    """Run the whole demo; returns where the reports are."""
    if cli_main is None:
        from meshplan.cli import main as cli_main
    result = DemoResult()
    say(f"[demo] meshplan demo into {config.out_dir}: calibrate, profile, plan, train and report "
        f"{config.small_model} on {config.num_local_processes} local processes, then plan {config.large_model} "
        f"on {config.large_gpus} GPUs of {config.large_cluster} (a few minutes)")
    start_s = time.perf_counter()
    result.small_report = run_local_loop(config, cli_main, result, say)
    result.large_report = run_large_plan(config, cli_main, result, say)
    result.step_times_s["total"] = time.perf_counter() - start_s
    return result
