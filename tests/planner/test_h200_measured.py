"""Predicted against measured on a real H200: the single-GPU plans `benchmarks/gpu_check.py`
trained with `meshplan train`, stored in benchmarks/data/ (h200_gpu_check.json: the first check;
h200_gpu_check_rerun.json: the same three plans and GPT 1.3B at 4 micro-batches of 4, each step
profiled; h200_gpu_check_lean.json: the three GPT plans after the executor kept ZeRO-0/1/2
parameters gathered across micro-batches). Nothing was fitted to them. The shipped h200
profile's per-GPU memory must stay within 7% of each run's `torch.cuda.max_memory_allocated`
(the worst, GPT 1.3B at micro-batch 16, reads +5.8%), and the largest plan, sized by `plan` to
129.9 of 137.5 usable GiB, within 1%. Step times of the runs of at most 4 micro-batches within 6%
(the rest: the README's "Checked on a GPU")."""
import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
FILES = ("h200_gpu_check.json", "h200_gpu_check_rerun.json", "h200_gpu_check_lean.json")
RUNS = {f"{file}: {name}": run for file in FILES for name, run in json.loads((DATA / file).read_text()).items()
        if name.startswith("train ") and isinstance(run, dict)}


def test_the_stored_checks_trained_every_plan():
    assert len(RUNS) == 3 + 4 + 3 and all(run["train_rc"] == 0 for run in RUNS.values())


def test_keeping_parameters_gathered_left_the_peak_as_it_was():
    """The lean executor's peaks equal the re-gathering one's to 0.1%: the gathered bf16
    parameters were already held from each forward's end to its backward's start."""
    for name in ("train gpt-1.3b", "train gpt-1.3b-mbs4", "train gpt-1.3b-mbs2"):
        before = RUNS[f"h200_gpu_check_rerun.json: {name}"]["measured"]["peak_memory_bytes"]
        after = RUNS[f"h200_gpu_check_lean.json: {name}"]["measured"]["peak_memory_bytes"]
        assert abs(after / before - 1) < 1e-3, (name, before, after)


def _estimate(run_cli, run) -> dict:
    """`estimate --json` of a stored run's plan on the shipped h200 profile."""
    predicted = run["predictions"]["h200"]
    code, out, err = run_cli("estimate", "--model", run["model"], "--cluster", "h200", "--gpus", 1, "--gbs", run["gbs"],
                             "--seq", run["seq"], "--mbs", predicted["microbatch_size"], "--recompute",
                             predicted["recompute"], "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_h200_memory_matches_the_measured_peak(name, run_cli):
    run = RUNS[name]
    peak_bytes = _estimate(run_cli, run)["peak_memory_bytes"]
    measured = run["measured"]["peak_memory_bytes"]
    assert abs(peak_bytes / measured - 1) <= (0.01 if name.endswith("train llama-4.5b") else 0.07), (peak_bytes, measured)


def _slope(points):
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


def test_what_each_micro_batch_adds_on_the_gpu(run_cli):
    """The same 16 samples in 1, 4 and 8 micro-batches (the lean executor's runs): the step time
    each extra micro-batch adds in the model against the GPU's busy time per step in the step
    profiles (519.5, 543.5 and 568.0 ms: 6.9 ms each). The model reads 5.7 ms, of which 3.2 ms is
    FSDP2's fp32 gradient accumulation (`state_memory.grad_copy_bytes_per_param`; 2.5 ms without
    it). Within 25%: the rest of the measured cost (smaller GEMMs, more kernels) is not modelled
    by micro-batch count. The wall clock adds 23.7 ms per micro-batch, the GPU waiting on the host."""
    predicted, busy = [], []
    for name in ("train gpt-1.3b", "train gpt-1.3b-mbs4", "train gpt-1.3b-mbs2"):
        run = RUNS[f"h200_gpu_check_lean.json: {name}"]
        mbs = run["predictions"]["h200"]["microbatch_size"]
        code, out, err = run_cli("estimate", "--model", run["model"], "--cluster", "h200", "--gpus", 1, "--gbs",
                                 run["gbs"], "--seq", run["seq"], "--mbs", mbs, "--json")
        assert code == 0, err
        count = run["gbs"] // mbs
        predicted.append((count, json.loads(out)["step_time_s"]))
        busy.append((count, run["step_profile"]["device_busy_ms_per_step"] / 1e3))
    assert _slope(busy) == pytest.approx(6.9e-3, rel=0.02)
    assert _slope(predicted) == pytest.approx(_slope(busy), rel=0.25)


@pytest.mark.parametrize("name", sorted(name for name in RUNS if not name.startswith("h200_gpu_check.json")
                                        and not name.endswith("-mbs2")))
def test_h200_step_time_up_to_four_micro_batches(name, run_cli):
    """The stored runs' step time against `estimate` on the shipped h200 profile, for the runs of at
    most 4 micro-batches: within 6%, meshplan's executor's eager elementwise kernels counted op by
    op (`eager_kernels`). Measured today: GPT 1.3B +2.3%, -4.2% (re-gathering executor), -4.3%,
    -2.0% (lean), the Llama-shaped 4.5B +0.8%, where the fused-kernel rule read -16.3%. The
    8-micro-batch rows, whose GPU waits on the host's eager launches (226 ms of the lean run's
    profiled step), are left out: no term prices the host. (The first check's runs predate its
    timers' fix.)"""
    run = RUNS[name]
    step_s = _estimate(run_cli, run)["step_time_s"]
    assert step_s == pytest.approx(run["measured"]["step_time_s"], rel=0.06), (step_s, run["measured"]["step_time_s"])
