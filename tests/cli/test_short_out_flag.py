"""`-o` is `--out` on every command that writes a file (plan, export, report, train, measured,
calibrate): a user's first `meshplan plan ... -o plan.json` works."""
from __future__ import annotations

import json

import pytest

from meshplan.cli import build_parser

JOB = ("--model", "gpt:layers=2,hidden=128,heads=4,vocab=512", "--cluster", "a100-80g", "--gpus", "2", "--gbs", "4",
       "--seq", "128")


@pytest.mark.parametrize("command", ["plan", "export", "report", "train", "measured", "calibrate"])
def test_every_writing_command_takes_o_for_out(command):
    parser = build_parser()
    sub = next(action for action in parser._actions if action.dest == "command").choices[command]
    out = next(action for action in sub._actions if action.dest == "out")
    assert out.option_strings == ["-o", "--out"]


def test_plan_and_export_write_where_o_says(run_cli, tmp_path):
    plan_path, toml_path = tmp_path / "plan.json", tmp_path / "job.toml"
    code, out, err = run_cli("plan", *JOB, "-o", str(plan_path))
    assert code == 0, err
    assert json.loads(plan_path.read_text())["global_batch"] == 4
    code, out, err = run_cli("export", "--plan", str(plan_path), "--to", "torchtitan", "-o", str(toml_path))
    assert code == 0, err
    assert "[parallelism]" in toml_path.read_text()
