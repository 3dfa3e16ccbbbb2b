"""The command line's manners: --version, Ctrl-C, closed pipes, progress only on a terminal, file
models in samples, --memory-headroom, `compare`, the top-K table, --seq 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bad_input_helpers import assert_clean

SPEC = "gpt:layers=4,hidden=256,heads=4,vocab=1024"
BASE = ("plan", "--model", SPEC, "--cluster", "a100-80g", "--gpus", "4", "--gbs", "16", "--seq", "256")
CNN_FILE = '''
import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    return model, torch.randn(1, 3, 16, 16)
'''


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    """Two plans of the same job: the searched winner, and one pinned to tp=2."""
    from meshplan.cli import main

    folder = tmp_path_factory.mktemp("plans")
    paths = folder / "a.json", folder / "b.json"
    assert main([*BASE, "--json", "--out", str(paths[0])]) == 0
    assert main([*BASE, "--json", "--tp", "2", "--out", str(paths[1])]) == 0
    return paths


def _command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "meshplan.cli", *argv]


def test_version(run_cli):
    from importlib.metadata import version

    code, out, err = run_cli("--version")
    assert code == 0 and out.strip() == f"meshplan {version('meshplan')}"


def _session_processes(session_id: int) -> list[int]:
    """Live processes of a session (Linux /proc): what an interrupted command left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session_id and fields[0] != "Z":
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds leftover processes through /proc")
@pytest.mark.parametrize("when", ["importing", "in the pool"])
def test_ctrl_c_exits_130_with_one_line_and_no_orphans(when):
    # A search of many seconds with the expert-parallel axis: the interrupt lands before it ends,
    # either one second in (imports, profile) or once the search's worker pool has forked.
    process = subprocess.Popen(_command("plan", "--model", "qwen3-235b-a22b", "--cluster", "h100-sxm", "--gpus",
                                        "256", "--gbs", "1024", "--seq", "4096"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if when == "importing":
        time.sleep(1.0)
    else:
        deadline = time.monotonic() + 60
        while len(_session_processes(process.pid)) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert process.poll() is None, process.communicate()
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    # the request's own notes (an MoE model's routing assumption) may come first; nothing else
    assert out == "" and [line for line in err.splitlines() if not line.startswith("note: ")] == [
        "meshplan plan: interrupted"], err
    deadline = time.monotonic() + 10
    while _session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_processes(process.pid) == []


def test_a_closed_pipe_ends_quietly(plan_files):
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head -1` once it has its line: the reader is gone
    try:
        done = subprocess.run(_command("simulate", "--plan", str(plan_files[0])), stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and done.stderr == ""


def test_progress_only_on_a_terminal_and_as_a_callback(run_cli, monkeypatch):
    import meshplan
    from meshplan.planner.contracts import progress

    code, out, err = run_cli(*BASE, "--top", "2")
    assert code == 0 and err == ""  # stderr is not a terminal here: no bar
    calls = []
    meshplan.plan(SPEC, "a100-80g", 4, 16, 256, top_k=2, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] and [c[0] for c in calls] == sorted(c[0] for c in calls)
    assert progress.progress_reporter(True, 10, "x", "unit") is None  # not a terminal
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    bar = progress.progress_reporter(True, 10, "x", "unit")
    bar.advance_to(4), bar.update(), bar.close()
    assert bar.done == 5


def test_file_models_are_counted_in_samples(run_cli, tmp_path):
    path = tmp_path / "cnn.py"
    path.write_text(CNN_FILE)
    job = ("--model", f"{path}:build", "--cluster", "cpu", "--gpus", "2", "--gbs", "8")
    code, out, err = run_cli("estimate", *job)
    assert code == 0, err
    assert "samples/s" in out and "tokens/s" not in out and "attention" not in out
    code, out, err = run_cli("plan", *job, "--top", "2")
    assert code == 0, err
    head = out.splitlines()[0]
    assert "seq" not in head and "tokens" not in out
    code, out, err = run_cli("profile", "--model", f"{path}:build", "--dtype", "fp32")
    assert code == 0, err
    head = out.splitlines()[0]
    assert "batch 1 sample(s)" in head and " seq " not in head and "attention flash" not in head
    code, out, err = run_cli("estimate", "--model", SPEC, "--cluster", "cpu", "--gpus", "2", "--gbs", "8")
    assert code == 0 and "tokens/s" in out  # a causal LM keeps its tokens
    # JSON: samples/s for the file model; no sequence or attention keys in its profile
    code, out, err = run_cli("estimate", *job, "--json")
    data = json.loads(out)
    assert code == 0 and data["samples_per_s"] == pytest.approx(data["tokens_per_s"] / 2048)
    code, out, err = run_cli("profile", "--model", f"{path}:build", "--dtype", "fp32", "--json")
    assert code == 0 and not {"seq", "attention"} & set(json.loads(out))
    plan_path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *job, "--top", "1", "--out", plan_path)
    code, out, err = run_cli("simulate", "--plan", plan_path)
    assert code == 0 and "samples/s" in out and "tokens/s" not in out and "seq" not in out.splitlines()[0]
    code, out, err = run_cli("simulate", "--plan", plan_path, "--json")
    assert code == 0 and "samples_per_s" in json.loads(out)


def test_memory_headroom_is_left_free(run_cli):
    gib = 2**30
    job = ("plan", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8", "--seq", "4096",
           "--json", "--top", "2")
    code, out, err = run_cli(*job)
    assert code == 0, err
    plain = json.loads(out)
    headroom_gib = 30.0
    code, out, err = run_cli(*job, "--memory-headroom", str(headroom_gib))
    assert code == 0, err
    data = json.loads(out)
    device = plain["cluster"]["embedded"]["device"]
    usable = device["memory_bytes"] - device["reserved_memory_bytes"]
    # Without headroom the winner needs more than usable - 30 GiB; with it, every GPU keeps 30 GiB free.
    assert plain["prediction"]["peak_memory_bytes"] > usable - headroom_gib * gib
    assert data["prediction"]["peak_memory_bytes"] <= usable - headroom_gib * gib
    assert data["solver"]["memory_headroom_bytes"] == headroom_gib * gib
    code, _, err = run_cli(*job, "--memory-headroom", "100")
    assert_clean("plan", code, err)
    assert code == 2 and "--memory-headroom" in err


def test_compare_and_report_side_by_side(run_cli, plan_files, tmp_path):
    code, out, err = run_cli("compare", *plan_files)
    assert code == 0, err
    lines = out.splitlines()
    assert "a.json" in lines[0] and "b.json" in lines[0]
    marked = {line[2:].split("  ")[0] for line in lines if line.startswith("* ")}
    assert "mesh (pp x dp x cp x tp)" in marked and "step time" in marked
    assert "global batch" not in marked and "fastest:" in out
    for name in ("mesh", "schedule", "ZeRO", "step time", "MFU", "peak memory per GPU", "throughput"):
        assert any(line[2:].startswith(name) for line in lines), name
    code, _, err = run_cli("compare", plan_files[0])
    assert_clean("compare", code, err)
    assert code == 2
    report = tmp_path / "report.html"
    code, out, err = run_cli("report", "--plan", plan_files[0], "--plan", plan_files[1], "--out", report)
    assert code == 0, err
    html = report.read_text()
    assert '<section id="plans">' in html and 'id="fig-plans"' in html and "b.json" in html
    assert '<section id="summary">' in html


def test_top_table_has_no_duplicate_rows_nor_an_index_row(run_cli):
    code, out, err = run_cli(*BASE, "--top", "8")
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "pp x dp x cp x tp" in line)
    assert lines[header].startswith("#")
    rows = []
    for line in lines[header + 1:]:
        if not line.strip():
            break
        assert line.strip() != "#"
        rows.append(line.split(None, 1)[1])  # without the rank
    assert rows and len(rows) == len(set(rows))
    assert [line.split()[0] for line in lines[header + 1:header + 1 + len(rows)]] == \
        [str(i) for i in range(1, len(rows) + 1)]


@pytest.mark.parametrize("command", ["plan", "estimate", "profile"])
def test_seq_zero_is_refused(run_cli, command):
    argv = [command, "--model", SPEC, "--seq", "0"]
    if command != "profile":
        argv += ["--cluster", "a100-80g", "--gpus", "4", "--gbs", "16"]
    code, out, err = run_cli(*argv)
    assert_clean(command, code, err)
    assert code == 2 and "--seq must be a positive integer" in err


def test_an_engine_flag_name_is_answered_with_meshplans(run_cli):
    """Megatron-LM's and torchtitan's names for batch, sequence and parallel degrees are refused
    with the flag meshplan calls them, in the same one line (and `--from` where it applies)."""
    code, out, err = run_cli("estimate", "--model", SPEC, "--cluster", "a100-80g", "--gpus", "4",
                             "--global-batch-size", "16", "--tensor-model-parallel-size=2")
    assert_clean("estimate", code, err)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "Megatron-LM's --global-batch-size is --gbs here" in err
    assert "Megatron-LM's --tensor-model-parallel-size is --tp here" in err and "--from FILE" in err
    code, out, err = run_cli("plan", "--model", SPEC, "--cluster", "a100-80g", "--gpus", "4", "--gbs", "16",
                             "--parallelism.pipeline_parallel_degree", "2")
    assert code == 2 and "torchtitan's --parallelism.pipeline_parallel_degree is --pp here" in err
    assert "--from" not in err  # plan reads no engine file
    code, out, err = run_cli("estimate", "--no-such-flag", "1")
    assert code == 2 and "here" not in err and "unrecognized arguments: --no-such-flag 1" in err
    assert "did you mean" not in err


def test_a_misspelt_flag_is_answered_with_the_nearest_of_the_commands():
    """A flag the command does not have, close in spelling to one it has, names that one (difflib's
    ratio at least `flag_hints.TYPO_CUTOFF`); an engine's flag keeps its own hint."""
    from meshplan.flag_hints import TYPO_CUTOFF, hint

    flags = {"--compile": None, "--fp8-recipe": None, "--gbs": None, "--from": None, "-h": None}
    assert hint(["--torch-compile"], flags) == " (--torch-compile: did you mean --compile?)"
    assert hint(["--fp8recipe=rowwise"], flags) == " (--fp8recipe: did you mean --fp8-recipe?)"
    assert hint(["--no-such-flag", "1"], flags) == ""
    assert hint(["--global-batch-size", "--fp8_recipe"], flags) == (
        " (Megatron-LM's --global-batch-size is --gbs here; --fp8_recipe: did you mean --fp8-recipe?; "
        "--from FILE reads the engine's own file whole)")
    assert 0.6 < TYPO_CUTOFF <= 0.75  # --torch-compile / --compile: 2 x 9 / 24 = 0.75


def test_virtual_stages_imply_the_interleaved_schedule(run_cli):
    """`--vpp V` (V > 1) alone prices interleaved 1F1B, as Megatron-LM's virtual pipeline size
    does, and says so on stderr; a schedule named beside it is taken as named (1F1B with virtual
    stages is refused in one line)."""
    job = ("estimate", "--model", "llama3-8b", "--cluster", "h100-sxm", "--gpus", 16, "--gbs", 64, "--zero", 1,
           "--pp", 2, "--vpp", 2)
    code, out, err = run_cli(*job)
    assert code == 0, err
    assert "schedule=interleaved vpp=2" in out
    assert "schedule: interleaved, which --vpp 2 implies (--schedule to change it)" in err
    named = run_cli(*job, "--schedule", "interleaved")
    assert named[0] == 0 and named[1] == out and "implies" not in named[2]
    code, out, err = run_cli(*job, "--schedule", "1f1b")
    assert code == 2 and "need --schedule interleaved or zb-interleaved" in err and err.count("\n") == 1
    code, out, err = run_cli(*job[:-2])
    assert code == 0 and "schedule=1f1b" in out and "implies" not in err
