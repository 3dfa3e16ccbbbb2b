"""`meshplan export`, `estimate --from`, `plan --like` and `plan --train-tokens --deadline-days`:
outputs, and bad input answered with exit 2 and one line."""
from __future__ import annotations

import json

import pytest

from meshplan.planner.contracts.plan import save_plan
from tests.planner.engines.helpers import SEQ, SPEC, make_plan


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(make_plan(zero=0, pp=2), path)
    return path


def _one_line_error(code, err, *words):
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("engine", ["torchtitan", "megatron", "deepspeed"])
def test_export_then_estimate_from(run_cli, plan_file, tmp_path, engine):
    out = tmp_path / f"config.{engine}"
    code, stdout, err = run_cli("export", "--plan", plan_file, "--to", engine, "--out", out)
    assert code == 0 and stdout == "" and f"written to {out}" in err
    code, stdout, err = run_cli("estimate", "--from", out, "--engine", engine, "--model", SPEC, "--seq", SEQ,
                                "--cluster", "a100-80g", "--json")
    assert code == 0, err
    assert json.loads(stdout)["step_time_s"] > 0


def test_export_to_stdout_and_notes_on_stderr(run_cli, tmp_path):
    path = tmp_path / "plan.json"
    save_plan(make_plan(zero=1, pp=1, dp=4), path)
    code, stdout, err = run_cli("export", "--plan", path, "--to", "torchtitan")
    assert code == 0 and "[parallelism]" in stdout
    assert "approximated: ZeRO-1" in err


def test_estimate_from_prints_the_breakdown(run_cli, plan_file, tmp_path):
    out = tmp_path / "args.txt"
    assert run_cli("export", "--plan", plan_file, "--to", "megatron", "--out", out)[0] == 0
    code, stdout, err = run_cli("estimate", "--from", out, "--cluster", "a100-80g")
    assert code == 0, err
    assert "megatron config" in stdout and "step time" in stdout and "pp=2" in stdout


def test_export_errors(run_cli, plan_file, tmp_path):
    _one_line_error(*run_cli("export", "--plan", tmp_path / "missing.json", "--to", "megatron")[::2], "missing.json")


def test_estimate_from_errors(run_cli, plan_file, tmp_path):
    ds = tmp_path / "ds.json"
    assert run_cli("export", "--plan", plan_file, "--to", "deepspeed", "--out", ds)[0] == 0
    _one_line_error(*run_cli("estimate", "--from", ds, "--cluster", "a100-80g")[::2], "--model")
    _one_line_error(*run_cli("estimate", "--from", ds, "--model", SPEC)[::2], "--cluster")
    _one_line_error(*run_cli("estimate", "--from", tmp_path / "nope.toml", "--cluster", "a100-80g")[::2], "nope.toml")
    odd = tmp_path / "notes.txt"
    odd.write_text("hello\n")
    _one_line_error(*run_cli("estimate", "--from", odd, "--cluster", "a100-80g")[::2], "--engine")
    bad = tmp_path / "bad.toml"
    bad.write_text("[parallelism\n")
    _one_line_error(*run_cli("estimate", "--from", bad, "--cluster", "a100-80g")[::2], "TOML")
    _one_line_error(*run_cli("estimate", "--cluster", "a100-80g")[::2], "--model", "--from")


def test_plan_sizing_flags_need_train_tokens(run_cli):
    _one_line_error(*run_cli("plan", "--model", SPEC, "--cluster", "a100-80g", "--gpus", "8", "--gbs", "32",
                             "--deadline-days", "3")[::2], "--train-tokens")


def test_plan_deadline_sweep_and_like(run_cli, plan_file, tmp_path):
    args_file = tmp_path / "megatron.args"
    assert run_cli("export", "--plan", plan_file, "--to", "megatron", "--out", args_file)[0] == 0
    out = tmp_path / "sized.json"
    code, stdout, err = run_cli("plan", "--model", SPEC, "--seq", SEQ, "--cluster", "a100-80g", "--gpus", "16",
                                "--gbs", "32", "--like", args_file, "--pp", "1", "--train-tokens", "1e9",
                                "--deadline-days", "1000", "--usd-per-gpu-hour", "2", "--time-limit", "1",
                                "--out", out)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["mesh"]["tp"] == 2 and data["mesh"]["pp"] == 1  # tp from --like, pp from the command line
    sizing = data["sizing"]
    assert sizing["chosen_gpus"] == 8 and [row["gpus"] for row in sizing["frontier"]] == [8, 16]
    assert sizing["frontier"][0]["usd"] == pytest.approx(sizing["frontier"][0]["gpu_hours"] * 2)
    assert data["cluster"]["gpus"] == 8 and "chosen: 8 GPUs" in stdout


def test_estimate_from_a_plan_and_a_deepspeed_config_without_seq(run_cli, plan_file, tmp_path):
    """A plan.json is predicted as the plan (not read as a DeepSpeed config); a DeepSpeed config
    names no sequence length, so estimate --from asks for --seq instead of assuming one."""
    code, stdout, err = run_cli("estimate", "--from", plan_file, "--json")
    assert code == 0, err
    from meshplan.planner.contracts.plan import load_plan
    from meshplan.planner.simulation.simulator import simulate

    assert json.loads(stdout)["step_time_s"] == simulate(load_plan(plan_file), timeline=False).step_time_s
    ds = tmp_path / "ds.json"
    assert run_cli("export", "--plan", plan_file, "--to", "deepspeed", "--out", ds)[0] == 0
    _one_line_error(*run_cli("estimate", "--from", ds, "--model", SPEC, "--cluster", "a100-80g")[::2], "--seq")


def test_export_warns_when_the_engine_would_not_fit(run_cli, tmp_path):
    """ZeRO-3 on a GPU the plan's own recipe just fits: under Megatron FSDP's recipe (fp32
    gradients) the export is predicted not to fit, and says so on stderr; exit 0 (it is written)."""
    from dataclasses import replace

    from meshplan.planner.engines.bridge import export_plan, predict_job, read_engine_text

    plan = make_plan(zero=3, pp=1, dp=4, tp=1, sp=False)
    megatron = predict_job(read_engine_text(export_plan(plan, "megatron").text, "megatron"), SPEC, plan.cluster,
                           seq=SEQ).prediction.peak_memory_bytes
    from meshplan.planner.simulation.simulator import simulate

    own = simulate(plan, timeline=False).peak_memory_bytes
    assert megatron > own  # Megatron-LM keeps its gradients in fp32
    device = plan.cluster.device
    usable = (own + megatron) / 2  # between the two peaks
    small = replace(plan.cluster, device=replace(device, memory_bytes=int(device.reserved_memory_bytes + usable)))
    path = tmp_path / "plan.json"
    save_plan(replace(plan, cluster=small), path)
    code, stdout, err = run_cli("export", "--plan", path, "--to", "megatron")
    assert code == 0 and "meshplan export: warning: predicted not to fit under megatron" in err, err
    assert "--use-megatron-fsdp" in stdout
    # torchtitan's own recipe (FSDP2 and the allocator's reserve): warned exactly when it does not fit
    titan = predict_job(read_engine_text(export_plan(plan, "torchtitan").text, "torchtitan"), SPEC, small,
                        seq=SEQ).prediction
    code, stdout, err = run_cli("export", "--plan", path, "--to", "torchtitan")
    assert code == 0 and ("predicted not to fit under torchtitan" in err) == (not titan.fits), err


def test_export_torchtitan_python_config(run_cli, plan_file, tmp_path):
    """An --out ending in .py is torchtitan's current Python config; estimate --from reads it back."""
    out = tmp_path / "job.py"
    code, _, err = run_cli("export", "--plan", plan_file, "--to", "torchtitan", "--out", out)
    assert code == 0, err
    assert "def meshplan_job() -> Trainer.Config:" in out.read_text()
    code, stdout, err = run_cli("estimate", "--from", out, "--cluster", "a100-80g", "--json")
    assert code == 0, err
    assert json.loads(stdout)["step_time_s"] > 0
    _one_line_error(*run_cli("export", "--plan", plan_file, "--to", "megatron", "--format", "python")[::2],
                    "--format python is torchtitan's")
