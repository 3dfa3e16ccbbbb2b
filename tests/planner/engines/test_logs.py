"""Engines' training logs (real excerpts, sources in each fixture's header) read into
Measurements, and a NeMo run reported against a plan's prediction."""
from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.measurement import load_measurement
from meshplan.planner.engines.logs import RunFacts, measurement_from_log

LOGS = Path(__file__).parent / "fixtures" / "logs"


def _read(name: str, engine: str, **facts):
    return measurement_from_log((LOGS / name).read_text(), engine, RunFacts(**facts), source=name)


def test_megatron_log():
    run = _read("megatron_mixtral_16xh100.log", "megatron", gpus=16, seq=4096)
    assert run.step_times_s == pytest.approx((5.3616, 5.4707, 5.8299))
    assert run.warmup_steps == 0  # logged from iteration 71: no start-up in these steps
    assert run.losses == pytest.approx((1.818812, 1.820313, 1.798953))
    assert run.tokens_per_step == 128 * 4096  # the global batch the log prints
    assert run.tokens_per_s == pytest.approx(128 * 4096 / ((5.3616 + 5.4707 + 5.8299) / 3))
    assert run.peak_memory_bytes_per_rank == ()  # this excerpt has no memory report


def test_megatron_memory_report_line():
    line = ("[Rank 0] (after 10 iterations) memory (MB) | allocated: 20542.5 | max allocated: 61234.0 | "
            "reserved: 64000.0 | max reserved: 64000.0")
    text = (LOGS / "megatron_mixtral_16xh100.log").read_text() + line + "\n"
    run = measurement_from_log(text, "megatron", RunFacts(gpus=2))
    assert run.peak_memory_bytes_per_rank == (61234.0 * 2**20, 0.0)
    assert "max allocated" in run.memory_source
    assert run.tokens_per_s == 0.0  # no sequence length given: tokens/s left unknown, not guessed


def test_nemo_log_read_as_megatron():
    run = _read("nemo_esm2.log", "megatron", gpus=1, seq=1024)
    assert run.step_times_s == pytest.approx((0.03146, 0.03163, 0.03215, 0.03157))
    assert run.losses == pytest.approx((1.233, 1.288, 1.333, 1.245))
    assert run.tokens_per_step == 1024


def test_torchtitan_log_steps_from_tokens_per_second():
    """torchtitan prints tokens/s per GPU, not step times: step = global tokens / (tps x GPUs)."""
    run = _read("torchtitan_llama3.log", "torchtitan", gpus=8, seq=8192, global_batch=32)
    tps = (5856, 5593, 5868, 5869)
    assert run.step_times_s == pytest.approx(tuple(32 * 8192 / (t * 8) for t in tps))
    assert run.losses == pytest.approx((6.1384, 6.0388, 6.0348, 5.9670))
    assert run.peak_memory_bytes_per_rank[0] == pytest.approx(49.66 * 2**30)
    assert set(run.peak_memory_bytes_per_rank[1:]) == {0.0} and len(run.peak_memory_bytes_per_rank) == 8
    with pytest.raises(MeshplanError, match="--gbs and --seq"):
        _read("torchtitan_llama3.log", "torchtitan", gpus=8)


def test_each_step_once_and_the_wrong_engine_named():
    text = (LOGS / "torchtitan_llama3.log").read_text()
    doubled = "\n".join(line.replace("[rank0]", "[rank1]") for line in text.splitlines()) + "\n" + text
    run = measurement_from_log(doubled, "torchtitan", RunFacts(gpus=8, seq=8192, global_batch=32))
    assert len(run.step_times_s) == 4
    with pytest.raises(MeshplanError, match="no megatron training step lines"):
        measurement_from_log(text, "megatron", RunFacts(gpus=8))


def test_deepspeed_throughput_timer():
    """The global batch over the timer's current samples/s; its MaxMemAllocated as the peak."""
    run = _read("deepspeed_timer.log", "deepspeed", gpus=8, seq=2048, global_batch=32)
    assert run.step_times_s == pytest.approx((32 / 8.00912418308922,))
    assert run.peak_memory_bytes_per_rank[0] == pytest.approx(63.31 * 2**30)


def test_deepspeed_pipeline_engine_line():
    # the pipeline engine's format: deepspeedai/DeepSpeed pull request #1934 (PipelineEngine._exec_schedule's print)
    text = "steps: 1 loss: 10.9512 iter time (s): 2.512 samples/sec: 12.740\n" \
           "steps: 2 loss: 10.7132 iter time (s): 1.601 samples/sec: 19.988\n"
    run = measurement_from_log(text, "deepspeed", RunFacts(gpus=8, seq=2048, global_batch=32))
    assert run.step_times_s == (2.512, 1.601) and run.warmup_steps == 1
    assert run.tokens_per_s == pytest.approx(32 * 2048 / 1.601)


def test_measured_command_then_report(run_cli, tmp_path):
    from meshplan.planner.contracts.plan import save_plan
    from tests.planner.engines.helpers import make_plan

    plan = tmp_path / "plan.json"
    save_plan(make_plan(zero=1, pp=2), plan)
    out = tmp_path / "measured.json"
    code, _, err = run_cli("measured", "--from", LOGS / "nemo_esm2.log", "--engine", "megatron", "--plan", plan,
                           "--out", out)
    assert code == 0, err
    run = load_measurement(out)
    assert run.world_size == 8 and run.median_step_time_s == pytest.approx(0.0316)
    code, _, err = run_cli("report", "--plan", plan, "--measured", out, "--out", tmp_path / "report.html")
    assert code == 0, err
    html = (tmp_path / "report.html").read_text()
    assert "Predicted vs measured" in html and "31.6" in html
    code, _, err = run_cli("measured", "--from", LOGS / "nemo_esm2.log", "--engine", "megatron", "--out", out)
    assert code == 2 and "--gpus" in err
