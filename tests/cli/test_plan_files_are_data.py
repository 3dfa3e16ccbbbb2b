"""Trust boundaries of the commands that read and write files: plans are data (reading one never runs
the model file it names), writes are atomic (a failure keeps the old file, leaves no temporary file
and is one line with the OS's reason), an --out that is an input is refused, and bad input (sizes the
solver cannot take, nesting too deep, devices, huge files, edited cache entries) exits 2 in one line."""
from __future__ import annotations

import errno
import json
import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.bad_input_helpers import SEQ, SMALL, fast, private_cache  # noqa: F401
from tests.executor.test_file_model_train import MODEL as FILE_MODEL

# the file model of the training tests, with a first line that leaves a mark when it is imported
MODEL = '''
import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("imported")
''' + FILE_MODEL


def one_error_line(command: str, code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert lines[0].startswith(f"meshplan {command}: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def file_plan(tmp_path_factory):
    """(directory, plan path) of a file model planned once for the module; the marker removed."""
    from meshplan.cli import main

    folder = tmp_path_factory.mktemp("filemodel")
    (folder / "mlp.py").write_text(MODEL)
    plan = folder / "plan.json"
    assert main(["plan", "--model", f"{folder / 'mlp.py'}:build", "--cluster", "cpu", "--gpus", "2", "--gbs", "4",
                 "--out", str(plan), "--time-limit", "1"]) == 0
    (folder / "RAN").unlink()
    return folder, plan


@pytest.fixture(scope="module")
def zoo_plan(tmp_path_factory):
    from meshplan.cli import main

    plan = tmp_path_factory.mktemp("zoo") / "plan.json"
    assert main(["plan", "--model", SMALL, "--cluster", "cpu", "--gpus", "2", "--gbs", "4", "--seq", str(SEQ),
                 "--out", str(plan), "--time-limit", "1"]) == 0
    return plan


# ---------------------------------------------------------------------------------------------
# Plans are data


def test_a_file_model_plan_carries_its_graph_and_reading_it_never_runs_the_file(run_cli, file_plan, tmp_path):
    from meshplan.planner.contracts.plan import load_plan

    folder, plan_path = file_plan
    data = json.loads(plan_path.read_text())
    plan = load_plan(plan_path)
    assert [layer["name"] for layer in data["model_graph"]["layers"]] == [layer.name for layer in plan.layers]
    assert plan.graph is not None and plan.graph.total_params == 8 * 16 + 16 + 16 * 4 + 4
    assert len(plan.model.digest) == 64  # sha256 of mlp.py, carried beside the graph
    for argv in (["simulate", "--plan", plan_path, "--trace", tmp_path / "trace.json"],
                 ["report", "--plan", plan_path, "--out", tmp_path / "report.html"],
                 ["compare", plan_path, plan_path],
                 ["export", "--plan", plan_path, "--to", "deepspeed", "--out", tmp_path / "ds.json"]):
        code, out, err = run_cli(*argv)
        assert code == 0, err
        assert not (folder / "RAN").exists(), f"`meshplan {argv[0]}` ran the model file"
        assert "running model code" not in err
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_an_older_plan_without_the_graph_is_refused_without_running_the_file(run_cli, file_plan, tmp_path):
    folder, plan_path = file_plan
    data = json.loads(plan_path.read_text())
    del data["model_graph"]
    data["prediction"] = None  # compare would otherwise read the recorded prediction only
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    for argv in (["simulate", "--plan", old], ["report", "--plan", old, "--out", tmp_path / "r.html"],
                 ["compare", old, plan_path]):
        code, _, err = run_cli(*argv)
        line = one_error_line(argv[0], code, err)
        assert "carries no layer graph" in line and "re-plan it" in line
        assert not (folder / "RAN").exists()
    assert not (tmp_path / "r.html").exists()


def test_the_commands_that_run_a_model_file_say_so(run_cli, file_plan, no_launch):
    folder, plan_path = file_plan
    code, _, err = run_cli("profile", "--model", f"{folder / 'mlp.py'}:build", "--no-cache")
    assert code == 0 and f"meshplan profile: running model code from {folder / 'mlp.py'}" in err
    (folder / "RAN").unlink()
    code, _, err = run_cli("train", "--plan", plan_path, "--out", folder / "measured.json")
    assert code == 2 and f"meshplan train: running model code from {folder / 'mlp.py'}" in err, err
    assert err.index("running model code") < err.index("error:")  # said before the run starts


def test_a_carried_graph_that_is_not_the_plans_model_is_refused(run_cli, file_plan, tmp_path):
    _, plan_path = file_plan
    data = json.loads(plan_path.read_text())
    data["model_graph"]["layers"][0]["name"] = "renamed"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    line = one_error_line("simulate", *run_cli("simulate", "--plan", edited)[::2])
    assert "model_graph's 2 layers are not the plan's 2 layers" in line
    data["model_graph"] = [1, 2]
    edited.write_text(json.dumps(data))
    assert "plan field 'model_graph' must be an object" in one_error_line(
        "simulate", *run_cli("simulate", "--plan", edited)[::2])


def test_a_zoo_plan_carries_no_graph(zoo_plan):
    assert "model_graph" not in json.loads(zoo_plan.read_text())


def test_an_edited_profile_cache_entry_is_profiled_again(tmp_path, monkeypatch, capsys):
    from meshplan.planner.profiling.profiler import profile

    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "mlp.py").write_text(MODEL)
    spec = f"{tmp_path / 'mlp.py'}:build"
    first = profile(spec, 8)
    [entry] = (tmp_path / "cache" / "profiles").glob("*.json")
    stored = json.loads(entry.read_text())
    stored["graph"]["layers"][0]["fwd_flops"] *= 1000  # a hand edit that keeps the JSON valid
    entry.write_text(json.dumps(stored))
    capsys.readouterr()
    again = profile(spec, 8)
    assert again == first and again.layers[0].fwd_flops == first.layers[0].fwd_flops
    assert "does not match its digest" in capsys.readouterr().err
    assert profile(spec, 8) == first and capsys.readouterr().err == ""  # rewritten: it verifies again


# ---------------------------------------------------------------------------------------------
# --out equal to an input


def test_train_out_equal_to_the_plan_is_refused_and_the_plan_kept(run_cli, zoo_plan, no_launch):
    before = zoo_plan.read_bytes()
    line = one_error_line("train", *run_cli("train", "--plan", zoo_plan, "--out", zoo_plan)[::2])
    assert "--out" in line and "is the --plan input" in line
    assert zoo_plan.read_bytes() == before and no_launch == []


def test_the_python_train_refuses_out_equal_to_the_plan(zoo_plan, no_launch):
    """`meshplan.train` (the API, not only the command) keeps the plan an `out` names."""
    import meshplan
    from meshplan.planner.contracts.errors import MeshplanError

    before = zoo_plan.read_bytes()
    with pytest.raises(MeshplanError, match="out .* is the plan input"):
        meshplan.train(str(zoo_plan), out=str(zoo_plan), steps=1)
    assert zoo_plan.read_bytes() == before and no_launch == []


def test_an_output_that_is_an_input_is_refused(run_cli, zoo_plan, tmp_path):
    before = zoo_plan.read_bytes()
    link = tmp_path / "link.json"
    link.symlink_to(zoo_plan)  # another name of the same file
    for argv in (["report", "--plan", zoo_plan, "--out", link], ["export", "--plan", zoo_plan, "--to", "megatron",
                                                                  "--out", zoo_plan],
                 ["simulate", "--plan", zoo_plan, "--trace", zoo_plan]):
        line = one_error_line(argv[0], *run_cli(*argv)[::2])
        assert "is the --plan input" in line
    assert zoo_plan.read_bytes() == before


# ---------------------------------------------------------------------------------------------
# Atomic writes


@pytest.mark.parametrize("command", ["plan", "report", "export", "simulate"])
def test_out_on_a_full_device_is_one_line_with_the_os_reason(run_cli, zoo_plan, command):
    argv = {"plan": ["plan", "--model", SMALL, "--cluster", "cpu", "--gpus", "2", "--gbs", "4", "--seq", SEQ,
                     "--time-limit", "1", "--out", "/dev/full"],
            "report": ["report", "--plan", zoo_plan, "--out", "/dev/full"],
            "export": ["export", "--plan", zoo_plan, "--to", "torchtitan", "--out", "/dev/full"],
            "simulate": ["simulate", "--plan", zoo_plan, "--trace", "/dev/full"]}[command]
    code, _, err = run_cli(*argv)
    err = "\n".join(line for line in err.splitlines() if "approximated" not in line)  # export's notes
    assert "No space left on device" in one_error_line(command, code, err)
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")  # written in place, never replaced


@pytest.mark.parametrize("where,number", [("fsync", errno.ENOSPC), ("mkstemp", errno.EROFS)])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(run_cli, zoo_plan, tmp_path, monkeypatch,
                                                                    where, number):
    from meshplan.planner.contracts import atomicfile

    out = tmp_path / "report.html"
    out.write_text("the old report")

    def fail(*args, **kwargs):
        raise OSError(number, os.strerror(number))

    monkeypatch.setattr(atomicfile.os if where == "fsync" else atomicfile.tempfile, where, fail)
    line = one_error_line("report", *run_cli("report", "--plan", zoo_plan, "--out", out)[::2])
    assert os.strerror(number) in line and str(out) in line
    assert out.read_text() == "the old report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_one_line(run_cli, zoo_plan, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        line = one_error_line("report", *run_cli("report", "--plan", zoo_plan, "--out", folder / "r.html")[::2])
    finally:
        folder.chmod(0o755)
    assert "Permission denied" in line and list(folder.iterdir()) == []


def test_a_reader_never_sees_a_torn_file(tmp_path):
    from meshplan.planner.contracts.atomicfile import write_text_atomic

    target = tmp_path / "plan.json"
    documents = [json.dumps({"n": n, "pad": "x" * 50_000 * (n % 3)}) for n in range(60)]
    write_text_atomic(target, documents[0])
    seen, done = [], threading.Event()

    def read():
        while not done.is_set():
            seen.append(json.loads(target.read_text())["n"])  # an empty or partial file fails here

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for text in documents:
            write_text_atomic(target, text)
    finally:
        done.set()
        reader.join()
    assert seen and json.loads(target.read_text())["n"] == 59
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_a_new_file_gets_the_usual_permissions(tmp_path):
    from meshplan.planner.contracts.atomicfile import write_text_atomic

    umask = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "a.json", "{}")
    finally:
        os.umask(umask)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


# ---------------------------------------------------------------------------------------------
# Bad input exits 2 with one line


@pytest.mark.parametrize("flag,value,needle", [
    ("--seq", 1099511627776, "above meshplan's bound of 16,777,216 tokens"),
    ("--gbs", 2**40, "above meshplan's bound of 1,048,576 samples"),
    ("--gpus", 2**40, "above meshplan's bound of 1,048,576 GPUs"),
])
def test_sizes_beyond_the_bounds_never_reach_the_solver(run_cli, flag, value, needle):
    argv = {"--model": SMALL, "--cluster": "cpu", "--gpus": 2, "--gbs": 4, "--seq": SEQ, flag: value}
    for command in ("plan", "estimate"):
        args = [item for pair in argv.items() for item in pair]
        assert needle in one_error_line(command, *run_cli(command, *args)[::2])


def test_sequence_bound_in_profile(run_cli):
    assert "16,777,216" in one_error_line("profile", *run_cli("profile", "--model", SMALL, "--seq", 2**30)[::2])


def test_deeply_nested_inputs_are_one_line(run_cli, zoo_plan, tmp_path):
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    cases = (["simulate", "--plan", nested], ["report", "--plan", zoo_plan, "--measured", nested, "--out",
                                                tmp_path / "r.html"],
             ["report", "--plan", zoo_plan, "--trace", nested, "--out", tmp_path / "r.html"])
    for argv in cases:
        assert "nested too deeply" in one_error_line(argv[0], *run_cli(*argv)[::2])
    toml = tmp_path / "deep.toml"
    toml.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    line = one_error_line("estimate", *run_cli("estimate", "--model", SMALL, "--cluster", toml, "--gpus", 1,
                                               "--gbs", 1, "--seq", SEQ)[::2])
    assert "nested too deeply" in line


@pytest.mark.timeout(60)
def test_devices_and_directories_are_refused_before_reading(run_cli, tmp_path):
    line = one_error_line("estimate", *run_cli("estimate", "--model", SMALL, "--cluster", "/dev/zero", "--gpus", 1,
                                               "--gbs", 1, "--seq", SEQ)[::2])
    assert "/dev/zero is not a regular file" in line
    line = one_error_line("simulate", *run_cli("simulate", "--plan", "/dev/zero")[::2])
    assert "not a regular file" in line
    assert "is a directory" in one_error_line("simulate", *run_cli("simulate", "--plan", tmp_path)[::2])
    assert "/dev/zero" in one_error_line("profile", *run_cli("profile", "--model", "hf:/dev/zero", "--seq", 16)[::2])


def test_files_above_the_size_limit_are_refused_with_the_limit(run_cli, tmp_path, monkeypatch):
    from meshplan.planner.contracts import jsonfile

    monkeypatch.setattr(jsonfile, "MAX_INPUT_BYTES", 2**20)
    big = tmp_path / "big.json"
    big.write_text(" " * (2**20 + 1))
    assert "larger than meshplan's limit of 1 MiB" in one_error_line(
        "simulate", *run_cli("simulate", "--plan", big)[::2])
    toml = tmp_path / "big.toml"
    toml.write_text("#" * (2**20 + 1))
    assert "larger than meshplan's limit of 1 MiB" in one_error_line(
        "estimate", *run_cli("estimate", "--model", SMALL, "--cluster", toml, "--gpus", 1, "--gbs", 1)[::2])


@fast(60)
@given(st.binary(max_size=200) | st.integers(1, 3000).map(lambda depth: ("{\"a\":" * depth + "1" + "}" * depth).encode())
       | st.integers(1, 3000).map(lambda depth: ("[" * depth + "]" * depth).encode()))
def test_the_json_reader_returns_a_value_or_one_meshplan_error(tmp_path, data):
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.contracts.jsonfile import read_json_file

    path = tmp_path / "input.json"
    path.write_bytes(data)
    try:
        value = read_json_file(path, "plan", "fix it")
    except MeshplanError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
    else:
        assert value == json.loads(data.decode("utf-8"))
