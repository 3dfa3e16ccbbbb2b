"""`meshplan profile` end to end: JSON keys and batch scaling, the table, CSV, bad input, cache."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap

import pytest

SPEC = "gpt:layers=2,hidden=128,heads=4,vocab=500"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))


def test_json_has_the_documented_keys_and_scales_with_batch(run_cli):
    code, out, err = run_cli("profile", "--model", SPEC, "--seq", "64", "--json")
    assert code == 0 and err == ""
    one = json.loads(out)
    assert {"model", "seq", "batch", "dtype", "total_params", "layers"} <= set(one)
    assert (one["model"], one["seq"], one["batch"], one["dtype"]) == (SPEC, 64, 1, "bf16")
    layer_keys = {"name", "kind", "fwd_flops", "bwd_flops", "params", "param_bytes", "activation_bytes",
                  "output_bytes", "repeat_of", "tp_split", "act_tp_sharded_bytes", "act_tp_replicated_bytes",
                  "act_attn_score_bytes", "input_bytes"}
    assert all(layer_keys <= set(layer) for layer in one["layers"])
    assert [layer["kind"] for layer in one["layers"]] == ["embedding", "block", "block", "head"]
    assert one["layers"][2]["repeat_of"] == "blocks.0"
    assert one["total_params"] == sum(layer["params"] for layer in one["layers"])

    code, out, _ = run_cli("profile", "--model", SPEC, "--seq", "64", "--batch", "3", "--json")
    three = json.loads(out)
    for a, b in zip(one["layers"], three["layers"]):
        assert b["fwd_flops"] == 3 * a["fwd_flops"] and b["activation_bytes"] == 3 * a["activation_bytes"]
        assert b["params"] == a["params"]  # parameters do not scale with the batch


def test_table_collapses_repeats_and_prints_totals(run_cli):
    code, out, err = run_cli("profile", "--model", SPEC, "--seq", "64")
    assert code == 0 and err == ""
    assert "blocks.0-1 (x2)" in out and "blocks.1 " not in out
    assert "total:" in out and "params" in out and "GiB" in out


def test_csv_writes_one_row_per_layer(run_cli, tmp_path):
    target = tmp_path / "layers.csv"
    code, out, _ = run_cli("profile", "--model", SPEC, "--seq", "64", "--csv", target)
    assert code == 0
    rows = list(csv.DictReader(target.open()))
    assert [row["name"] for row in rows] == ["embed", "blocks.0", "blocks.1", "head"]
    assert int(rows[1]["fwd_flops"]) > 0 and rows[1]["tp_split"] == "block"


def test_default_seq_is_capped_for_gpt2(run_cli):
    code, out, _ = run_cli("profile", "--model", "gpt2", "--json")
    assert code == 0 and json.loads(out)["seq"] == 1024


_FILES = {
    "raises.py": "def build():\n    raise RuntimeError('boom')\n",
    "wrong.py": "def build():\n    return 42\n",
    "notmodule.py": "import torch\ndef build():\n    return 'x', torch.zeros(1)\n",
    "syntax.py": "def build(:\n",
    "item.py": textwrap.dedent("""
        import torch
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
            def forward(self, x):
                if x.sum().item() > 0:
                    return self.lin(x)
                return x
        def build():
            return M(), torch.zeros(1, 4)
        """),
}


@pytest.mark.parametrize("spec,needle", [
    ("nope", "known models: gpt2"),
    ("gpt:layers=2,hidden=64", "missing heads, vocab"),
    ("gpt:layers=2,hidden=64,heads=2,vocab=100,depth=3", "unknown key 'depth'"),
    ("{dir}/absent.py:build", "not found"),
    ("{dir}/wrong.py:missing", "has no function 'missing'"),
    ("{dir}/raises.py:build", "raised RuntimeError: boom"),
    ("{dir}/wrong.py:build", "must return (nn.Module, example_inputs)"),
    ("{dir}/notmodule.py:build", "its first item is str"),
    ("{dir}/syntax.py:build", "SyntaxError"),
    ("{dir}/item.py:build", "cannot run its forward on the meta device"),
    ("hf:{dir}/absent.json", "not found"),
])
def test_bad_input_exits_2_with_one_line(run_cli, tmp_path, spec, needle):
    for name, source in _FILES.items():
        (tmp_path / name).write_text(source)
    code, out, err = run_cli("profile", "--model", spec.format(dir=tmp_path), "--seq", "32")
    assert code == 2 and out == ""
    # a file model is announced before its code runs; the error is then one line
    lines = [line for line in err.strip().splitlines() if "running model code from" not in line]
    assert len(lines) == 1 and "Traceback" not in err
    assert needle in err


@pytest.mark.parametrize("args", [["--seq", "0"], ["--batch", "0"], ["--dtype", "int8"], ["--attention", "fast"]])
def test_bad_options_exit_2(run_cli, args):
    code, out, err = run_cli("profile", "--model", SPEC, *args)
    assert code == 2 and "Traceback" not in err


@pytest.mark.timeout(120)
def test_warm_cache_command_does_not_import_torch(tmp_path):
    env = {**os.environ, "MESHPLAN_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    # --trace: a zoo spec is otherwise computed in closed form, without torch and without the cache.
    code = ("import sys; from meshplan.cli import main; rc = main(['profile', '--model', %r, '--seq', '64', '--json',"
            " '--trace']);"
            " print('TORCH' if 'torch' in sys.modules else 'NOTORCH', file=sys.stderr); sys.exit(rc)") % SPEC
    cold = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    warm = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert cold.returncode == 0 and warm.returncode == 0, cold.stderr + warm.stderr
    assert "TORCH" in cold.stderr.split() and "NOTORCH" in warm.stderr.split()
    assert json.loads(cold.stdout) == json.loads(warm.stdout)
