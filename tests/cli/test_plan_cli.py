"""`meshplan plan` end to end through the CLI entry point (in process)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

SPEC = "gpt:layers=4,hidden=256,heads=4,vocab=1024"
BASE = ("plan", "--model", SPEC, "--cluster", "a100-80g", "--gpus", "4", "--gbs", "16", "--seq", "256")


def test_table_explanation_and_progress(run_cli, monkeypatch):
    from meshplan.planner.contracts import progress

    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    code, out, err = run_cli(*BASE, "--top", "3", "--train-tokens", "1e9")
    assert code == 0, err
    assert "pp x dp x cp x tp" in out and "step ms" in out and "peak GiB" in out
    assert "meshplan picks" in out and "runner-up" in out
    assert "GPU-hours" in out and "training on 1e+09 tokens" in out
    assert "candidate" in err  # on a terminal the progress bar goes to stderr
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    # at most the top 3, each of its own structure, then the conventional layout
    assert 2 <= len(rows) <= 4 and rows[-1].endswith("conventional")


def test_json_prints_only_the_plan_and_out_writes_it(run_cli, tmp_path):
    from meshplan.planner.contracts.plan import load_plan

    path = tmp_path / "plan.json"
    code, out, err = run_cli(*BASE, "--json", "--out", path)
    assert code == 0, err
    data = json.loads(out)
    for key in ("schema_version", "seed", "precision", "model", "cluster", "global_batch", "mesh", "zero", "sp",
                "schedule", "layers", "prediction", "alternatives", "solver"):
        assert key in data
    assert data["mesh"]["pp"] * data["mesh"]["dp"] * data["mesh"]["tp"] == 4
    assert data["prediction"]["fits"] and data["executable"]
    assert data["solver"]["status"] in ("optimal", "time_limit") and data["solver"]["backend"] in ("highs", "cbc")
    plan = load_plan(path)
    assert plan.to_json()["layers"] == data["layers"]
    for alt in data["alternatives"]:
        assert {"mesh", "zero", "sp", "schedule", "chunk_of_layer", "recompute_of_layer", "prediction",
                "why_not"} <= set(alt)
        assert len(alt["chunk_of_layer"]) == len(data["layers"])


def test_cli_pins(run_cli):
    code, out, err = run_cli(*BASE, "--json", "--tp", "2", "--pp", "2", "--zero", "2", "--mbs", "1",
                             "--schedule", "gpipe", "--top", "2")
    assert code == 0, err
    data = json.loads(out)
    assert data["mesh"] == {"pp": 2, "dp": 1, "tp": 2}
    assert data["zero"] == 2 and data["schedule"]["name"] == "gpipe" and data["schedule"]["microbatch_size"] == 1


def test_impossible_pins_exit_2(run_cli):
    code, out, err = run_cli(*BASE, "--tp", "3")
    assert code == 2 and out == ""
    assert "no parallel configuration" in err and "relax a pin" in err


def test_infeasible_cluster_exits_2_with_what_would_work(run_cli, tmp_path):
    from meshplan.planner.contracts.cluster import dump_cluster_toml
    from meshplan.planner.costing.hardware import load_cluster

    cluster = load_cluster("a100-80g")
    # 3 MiB usable per GPU: nothing of this 4-layer model fits on 4 GPUs, more GPUs do.
    device = replace(cluster.device, memory_bytes=cluster.device.reserved_memory_bytes + 3 * 2**20)
    path = tmp_path / "tiny.toml"
    path.write_text(dump_cluster_toml(replace(cluster, device=device, name="tiny")))
    # (unpinned, the search would offload the states to host memory: fitting on the GPUs alone)
    code, out, err = run_cli(*BASE[:4], str(path), *BASE[5:], "--offload", "none")
    assert code == 2 and out == ""
    message = err.strip().splitlines()[-1]  # after the progress bar
    assert message.startswith("meshplan plan: error: no plan of") and "GiB per GPU" in message
    assert "--gpus" in message


@pytest.mark.parametrize("flag,value", [("--gpus", "0"), ("--gbs", "-1"), ("--top", "0")])
def test_bad_numbers_exit_2(run_cli, flag, value):
    argv = list(BASE) + ["--top", "2"]
    argv[argv.index(flag) + 1] = value
    code, _, err = run_cli(*argv)
    assert code == 2 and flag in err


def test_time_to_train_equals_tokens_over_throughput(run_cli, tmp_path):
    """The printed days and GPU-hours follow from the winner's predicted tokens/s alone."""
    import re

    out_path = tmp_path / "plan.json"
    code, out, err = run_cli(*BASE, "--top", "2", "--train-tokens", "3e11", "--out", out_path)
    assert code == 0, err
    prediction = json.loads(out_path.read_text())["prediction"]
    seconds = 3e11 / prediction["tokens_per_s"]  # independent of the table's per-step route
    match = re.search(r"training on 3e\+11 tokens: ([0-9.]+) days, ([0-9,]+) GPU-hours", out)
    assert match, out
    # The CLI rounds days to 0.01 and GPU-hours to an integer.
    assert float(match.group(1)) == pytest.approx(seconds / 86400, abs=0.006)
    assert int(match.group(2).replace(",", "")) == pytest.approx(seconds * 4 / 3600, abs=0.6)
