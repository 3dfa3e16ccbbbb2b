"""Bad plan files and impossible requests: refused with exit 2 and one line, before anything launches.

Plans are mutated from a real `meshplan plan` output (hypothesis picks the field and the value)
and given to `simulate`, `report` and `train`. `train` runs with the launcher replaced by a stub,
so a plan that must be refused is shown to be refused before any process starts, and a valid
one is shown to reach the launch.
"""
from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.bad_input_helpers import SEQ, SMALL, assert_clean, base_cluster, fast, private_cache, toml_text  # noqa: F401


# ---------------------------------------------------------------------------------------------
# Plan files

@pytest.fixture(scope="module")
def base_plan(tmp_path_factory, private_cache) -> dict:
    """A real plan from `meshplan plan` for two processes, pp=2 (pins keep the search short)."""
    from meshplan.cli import main

    out = tmp_path_factory.mktemp("plan") / "plan.json"
    code = main(["plan", "--model", SMALL, "--seq", str(SEQ), "--cluster", "cpu", "--gpus", "2", "--gbs", "4",
                 "--pp", "2", "--tp", "1", "--zero", "0", "--schedule", "1f1b", "--mbs", "1", "--json",
                 "--out", str(out)])
    assert code == 0
    return json.loads(out.read_text())


def _drop(d, i):
    d["layers"].pop(i % len(d["layers"]))


def _duplicate(d, i):
    d["layers"].insert(i % len(d["layers"]), dict(d["layers"][i % len(d["layers"])]))


def _rename(d, i):
    d["layers"][i % len(d["layers"])]["name"] = "blocks.99"


def _swap(d, i):
    layers = d["layers"]
    j = i % (len(layers) - 1)
    layers[j], layers[j + 1] = layers[j + 1], layers[j]


def _extra_block(d, i):
    d["layers"].insert(len(d["layers"]) - 1, dict(d["layers"][-2], name=f"blocks.{len(d['layers']) - 2}"))


# Each breaks the plan by construction: simulate and train must refuse it (exit 2).
STRUCTURAL = {
    "drop a layer": _drop, "assign a layer twice": _duplicate, "rename a layer": _rename,
    "swap two layers": _swap, "add a block the model lacks": _extra_block,
    "degrees not multiplying to the world size": lambda d, i: d["mesh"].update(dp=1 + (i % 3) + 1),
    "gpus not matching the mesh": lambda d, i: d["cluster"].update(gpus=3 + i % 5),
    "wrong schema_version": lambda d, i: d.update(schema_version=[0, 3, "1", None][i % 4]),
    "unknown model": lambda d, i: d["model"].update(spec=f"gpt-{i}"),
    "model with more layers": lambda d, i: d["model"].update(spec=SMALL.replace("layers=2", f"layers={3 + i % 3}")),
    "fractional degree": lambda d, i: d["mesh"].update(pp=2.5),
}


@fast(25)
@given(kind=st.sampled_from(sorted(STRUCTURAL)), index=st.integers(0, 50))
def test_broken_plans_are_refused_before_anything_launches(run_cli, tmp_path, base_plan, no_launch, kind, index):
    plan = copy.deepcopy(base_plan)
    STRUCTURAL[kind](plan, index)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    for command in (["simulate", "--plan", path], ["train", "--plan", path, "--steps", 1],
                    ["report", "--plan", path, "--out", tmp_path / "r.html"]):
        code, _, err = run_cli(*command)
        assert_clean(command[0], code, err)
        assert code == 2, f"{kind}: {command[0]} accepted the plan"
    assert no_launch == [], f"{kind}: train launched processes"
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("value", [None, "1e9", -1.0, True])
def test_a_prediction_scalar_that_is_no_number_is_refused_naming_it(run_cli, tmp_path, base_plan, no_launch, value):
    """A hand-edited prediction scalar (null, a string, a negative or a boolean) is refused when
    the plan loads, naming the field, not met later as a crash deep in `train`'s preflight."""
    plan = copy.deepcopy(base_plan)
    plan["prediction"]["peak_memory_bytes"] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    for command in (["train", "--plan", path, "--steps", 1], ["simulate", "--plan", path]):
        code, _, err = run_cli(*command)
        assert code == 2 and "prediction.peak_memory_bytes must be a non-negative number" in err, err
    assert no_launch == []


def _json_paths(value, prefix=()):
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            out += _json_paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value[:2]):
            out += _json_paths(item, prefix + (index,))
    return out


JSON_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-2, 5), st.floats(-1, 3), st.text(max_size=4),
                       st.builds(list), st.builds(dict))


@fast(30)
@given(data=st.data())
def test_any_field_changed_or_removed_never_crashes(run_cli, tmp_path, base_plan, no_launch, data):
    plan = copy.deepcopy(base_plan)
    paths = _json_paths(plan)
    target = data.draw(st.sampled_from(paths), label="field")
    parent = plan
    for key in target[:-1]:
        parent = parent[key]
    if data.draw(st.booleans(), label="delete") and isinstance(parent, dict):
        del parent[target[-1]]
    else:
        parent[target[-1]] = data.draw(JSON_VALUE, label="value")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    code, out, err = run_cli("simulate", "--plan", path, "--json")
    assert_clean("simulate", code, err)
    if code == 0:
        assert json.loads(out)["step_time_s"] > 0
    code, _, err = run_cli("train", "--plan", path, "--steps", 1)
    assert_clean("train", code, err)
    # Whatever train accepted reached the launch with the plan's world size; nothing else did.
    assert all(nproc == 2 for nproc in no_launch)


def test_a_valid_plan_reaches_the_launch_and_nproc_must_match(run_cli, tmp_path, base_plan, no_launch):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(base_plan))
    code, _, err = run_cli("train", "--plan", path, "--steps", 1)
    assert code == 2 and "stopped at the launch by the test stub" in err, err
    assert no_launch == [2]
    for nproc in (1, 3, 4):
        code, _, err = run_cli("train", "--plan", path, "--steps", 1, "--nproc", nproc)
        assert code == 2 and "use --nproc 2" in err, err
    not_executable = dict(base_plan, executable=False, not_executable_reason="per-layer tp")
    path.write_text(json.dumps(not_executable))
    code, _, err = run_cli("train", "--plan", path, "--steps", 1)
    assert code == 2 and "not executable" in err, err
    assert no_launch == [2]  # only the valid plan launched


@pytest.mark.parametrize("content,expected", [
    ("{not json", "is not valid JSON"), ("", "is not valid JSON"), ("[1, 2]", "must be a JSON object"),
    ('{"schema_version": 7}', "schema_version is 7"),
])
@pytest.mark.parametrize("command", ["simulate", "report", "train"])
def test_unreadable_plan_files(run_cli, tmp_path, no_launch, content, expected, command):
    path = tmp_path / "plan.json"
    path.write_text(content)
    extra = {"report": ["--out", tmp_path / "r.html"], "train": ["--steps", 1]}.get(command, [])
    code, _, err = run_cli(command, "--plan", path, *extra)
    assert_clean(command, code, err)
    assert code == 2 and expected in err and str(path) in err, err
    assert not (tmp_path / "r.html").exists() and no_launch == []


# ---------------------------------------------------------------------------------------------
# Requests with no solution

def test_no_plan_fits_explains_memory_and_what_would_work(run_cli, tmp_path):
    """A 0.47 GiB device: the message names the memory limit, the need, and a device that fits."""
    data = base_cluster()
    data["device"].update(memory_bytes=1.5e9, reserved_memory_bytes=1e9)
    path = tmp_path / "tiny.toml"
    path.write_text(toml_text(data))
    model = "gpt:layers=4,hidden=1024,heads=16,vocab=50257"  # ~100M params: ~1.6 GB of fp32 Adam state
    code, _, err = run_cli("plan", "--model", model, "--seq", 128, "--cluster", path, "--gpus", 2, "--gbs", 2, "--json")
    assert_clean("plan", code, err)
    assert code == 2, err
    usable = re.search(r"\(([\d.]+) GiB usable per GPU\)", err)
    need = re.search(r"the leanest plan needs ([\d.]+) GiB per GPU", err)
    fits = re.search(r"devices with at least ([\d.]+) GiB", err)
    assert usable and need and fits, err
    assert float(usable.group(1)) == pytest.approx(0.5e9 / 2**30, abs=1e-3)  # 1.5e9 - 1e9 reserved
    assert float(need.group(1)) > float(usable.group(1))
    assert float(fits.group(1)) >= float(need.group(1))


def test_impossible_pins_say_what_to_relax(run_cli):
    code, _, err = run_cli("plan", "--model", SMALL, "--seq", SEQ, "--cluster", "cpu", "--gpus", 2, "--gbs", 4,
                           "--tp", 3, "--json")
    assert_clean("plan", code, err)
    assert code == 2 and "relax a pin" in err, err
    code, _, err = run_cli("estimate", "--model", SMALL, "--seq", SEQ, "--cluster", "cpu", "--gpus", 2,
                           "--gbs", 4, "--pp", 2, "--schedule", "interleaved", "--vpp", 3)
    assert code == 2 and "need at least 6 layers; the model has 4" in err, err


@pytest.mark.parametrize("command", ["profile", "plan", "simulate", "report", "demo"])
def test_outputs_under_a_file_or_onto_a_directory_exit_2(run_cli, tmp_path, base_plan, command):
    """Output paths that cannot be written: a directory given as a file, a file used as a directory."""
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(base_plan))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for target in (tmp_path, blocker / "out.x"):
        argv = {
            "profile": ["profile", "--model", SMALL, "--seq", SEQ, "--csv", target],
            "plan": ["plan", "--model", SMALL, "--seq", SEQ, "--cluster", "cpu", "--gpus", 1, "--gbs", 2,
                     "--out", target, "--json"],
            "simulate": ["simulate", "--plan", plan_path, "--trace", target, "--json"],
            "report": ["report", "--plan", plan_path, "--out", target],
            "demo": ["demo", "--out-dir", blocker],
        }[command]
        code, _, err = run_cli(*argv)
        assert_clean(command, code, err)
        assert code == 2, err


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_torchrun_world_size_other_than_the_plans_is_refused_by_the_workers(tmp_path, base_plan):
    """Launched by hand with the wrong process count, every worker refuses the plan before training."""
    from meshplan.executor.launch import TrainingFailed, launch_jobs
    from meshplan.executor.worker import Job

    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(base_plan))
    job = Job(plan_path=str(plan_path), steps=1, out=str(tmp_path / "m.json"), run_dir=str(tmp_path / "run"))
    with pytest.raises(TrainingFailed, match=r"rank 0 failed.*needs 2 processes.*but 1 were asked for"):
        launch_jobs([job.to_json()], 1, tmp_path / "run", timeout_s=100)
    assert not (tmp_path / "m.json").exists()
