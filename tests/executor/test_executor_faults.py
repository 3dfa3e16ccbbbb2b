"""Faults during training (killed in a save, hung worker, full disk, NaN loss) and the checks that
refuse a `meshplan train` request before any worker starts.

Faults are injected through `MESHPLAN_FAULT` (executor.faults), which the launch passes on to the
workers; each fires only in the first attempt of a launch.
"""
from __future__ import annotations

import json
import math
import time
from collections import namedtuple

import pytest

from tests.process_helpers import process_alive

from meshplan.executor import train
from meshplan.executor.launch import TrainingFailed
from meshplan.executor.plans import uniform_plan
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.contracts.plan import save_plan

# Tiny, so each launch costs little more than starting two processes.
SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=256"
STEPS = 6


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    save_plan(uniform_plan(SPEC, 16, 4, load_cluster("cpu"), dp=2, microbatch_size=2, seed=3), path)
    return path


@pytest.fixture(scope="module")
def clean(plan_path, tmp_path_factory):
    """An uninterrupted run: the reference every faulted run must match."""
    out = tmp_path_factory.mktemp("clean") / "m.json"
    return train(plan_path, steps=STEPS, out=out, run_dir=out.parent / "run")


def _same_losses(got, expected):
    # DCP restores weights, optimizer state and RNG exactly, so the same float32 arithmetic runs
    # again: 1e-6 relative leaves room only for a reordered reduction.
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        assert a == pytest.approx(b, rel=1e-6), f"step {step}"


def _assert_no_worker_left(run_dir):
    pids = [json.loads(path.read_text())["pid"] for path in run_dir.glob("rank*.json")]
    assert pids, "no heartbeat: the workers never started"
    assert not [pid for pid in pids if process_alive(pid)], "a worker outlived the failed run"


def _complete(directory):
    return sorted(int(path.parent.name[5:]) for path in directory.glob("step_*/COMPLETE"))


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_kill_during_a_save_resumes_from_the_previous_complete_checkpoint(plan_path, clean, tmp_path, monkeypatch):
    # Rank 1 dies after writing its shards of step_4, before the COMPLETE marker.
    monkeypatch.setenv("MESHPLAN_FAULT", "kill_in_save:rank=1,step=4")
    resumed = train(plan_path, steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run",
                    checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, max_restarts=1)
    assert json.loads((tmp_path / "run" / "rank1.json").read_text())["restart"] == 1
    assert resumed.resumed_from_step == 2  # the half-written step_4 was not loaded
    _same_losses(resumed.losses, clean.losses)
    assert _complete(tmp_path / "ckpt") == [2, 4, 6]  # step_4 written again, whole this time


# Expert parallelism: 2 ranks holding 2 of the 4 experts each (DTensor shards in the checkpoint).
MOE_SPEC = "moe:layers=2,hidden=32,heads=2,kv_heads=2,experts=4,top_k=2,expert_ffn=32,vocab=256"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [0, 3])
def test_a_killed_expert_parallel_run_resumes_with_the_uninterrupted_losses(zero, tmp_path, monkeypatch):
    plan = uniform_plan(MOE_SPEC, 16, 4, load_cluster("cpu"), dp=2, ep=2, zero=zero, microbatch_size=1, seed=3)
    save_plan(plan, tmp_path / "plan.json")
    clean = train(tmp_path / "plan.json", steps=STEPS, out=tmp_path / "clean.json", run_dir=tmp_path / "clean")
    monkeypatch.setenv("MESHPLAN_FAULT", "kill_in_save:rank=1,step=4")
    resumed = train(tmp_path / "plan.json", steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run",
                    checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, max_restarts=1)
    assert resumed.resumed_from_step == 2
    _same_losses(resumed.losses, clean.losses)
    assert _complete(tmp_path / "ckpt") == [2, 4, 6]


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_a_hung_worker_is_named_within_the_timeout_and_stopped(tmp_path, monkeypatch):
    # Three ranks: some wait on the stuck one directly, some on a peer that gave up.
    plan = uniform_plan(SPEC, 16, 3, load_cluster("cpu"), dp=3, microbatch_size=1, seed=3)
    monkeypatch.setenv("MESHPLAN_FAULT", "hang:rank=1,step=3")
    started = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"^rank 1 \(in step 3\) stopped responding: ranks? [0-9, ]+ timed out") \
            as info:
        train(plan, steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run", timeout_s=4)
    elapsed_s = time.monotonic() - started
    # Start-up (~5-20 s on a loaded 2-core machine) + 2 steps + the 4 s timeout + torchrun's
    # stop; without the timeout it would wait forever (the test's own 200 s limit).
    assert elapsed_s < 90, f"took {elapsed_s:.0f} s"
    assert len(str(info.value).splitlines()) == 1
    _assert_no_worker_left(tmp_path / "run")
    assert not (tmp_path / "m.json").exists()


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_a_full_disk_mid_run_keeps_earlier_checkpoints_loadable(plan_path, clean, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_FAULT", "enospc_in_save:step=4")
    ckpt = tmp_path / "ckpt"
    with pytest.raises(TrainingFailed, match=r"saving checkpoint step_4 .* failed \(No space left on device\); "
                                             r"the newest complete checkpoint, .*step_2, is intact"):
        train(plan_path, steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run", checkpoint_dir=ckpt,
              checkpoint_every=2)
    _assert_no_worker_left(tmp_path / "run")
    assert _complete(ckpt) == [2]
    monkeypatch.delenv("MESHPLAN_FAULT")
    resumed = train(plan_path, steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "resume",
                    checkpoint_dir=ckpt, resume=True)
    assert resumed.resumed_from_step == 2
    _same_losses(resumed.losses, clean.losses)


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_a_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(plan_path, clean, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_FAULT", "nan:rank=0,step=4")
    ckpt, out = tmp_path / "ckpt", tmp_path / "m.json"
    # Restarts are allowed but cannot cure a diverged run: the restarted workers stop at once.
    with pytest.raises(TrainingFailed, match=r"the loss became nan at step 4 .*the last good checkpoint is "
                                             r".*step_3; .*holds the 3 good step"):
        train(plan_path, steps=STEPS, out=out, run_dir=tmp_path / "run", checkpoint_dir=ckpt, checkpoint_every=1,
              max_restarts=1)
    _assert_no_worker_left(tmp_path / "run")
    assert _complete(ckpt) == [1, 2, 3]  # nothing saved from the NaN step on
    measured = json.loads(out.read_text())
    assert "at step 4" in measured["stopped"]
    _same_losses(measured["losses"], clean.losses[:3])
    # The kept checkpoint is the clean run's state after step 3: resuming reproduces steps 4..6.
    monkeypatch.delenv("MESHPLAN_FAULT")
    resumed = train(plan_path, steps=STEPS, out=out, run_dir=tmp_path / "resume", checkpoint_dir=ckpt, resume=True)
    assert resumed.resumed_from_step == 3 and resumed.stopped == ""
    _same_losses(resumed.losses, clean.losses)


# ---- refused before launch (no worker starts) ----

@pytest.mark.parametrize("extra,message", [
    (["--checkpoint-dir", "/proc/x", "--checkpoint-every", "1"], "--checkpoint-dir /proc/x cannot be created"),
    (["--checkpoint-dir", "/proc/x", "--resume"], "--checkpoint-dir /proc/x cannot be created"),
    (["--timeout-s", "-5"], "--timeout-s must be a positive number of seconds, got -5.0"),
    (["--timeout-s", "inf"], "argument --timeout-s: must be a finite number, got 'inf'"),
    (["--out", "/missing/dir/m.json"], "directory /missing/dir does not exist"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0; this plan needs --nproc 2"),
])
def test_train_refuses_bad_requests_before_launch(plan_path, run_cli, no_launch, extra, message):
    code, _, err = run_cli("train", "--plan", plan_path, "--steps", 1, *extra)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "--gpus 0" not in err
    assert no_launch == []


def test_train_refuses_a_checkpoint_dir_without_room_for_one_checkpoint(plan_path, run_cli, no_launch, tmp_path,
                                                                        monkeypatch):
    from meshplan.executor import checks as preflight
    from meshplan.executor.checkpoint import estimated_size_bytes

    # what DCP writes for this model on 2 ranks (a real one is measured in test_checkpoint_trust.py)
    needed = estimated_size_bytes(SPEC, 16, 2)
    assert 1.3e6 < needed < 1.4e6
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(10 * needed, 9 * needed, needed - 1))
    code, _, err = run_cli("train", "--plan", plan_path, "--steps", 4, "--checkpoint-dir", tmp_path / "c",
                           "--checkpoint-every", 2)
    assert code == 2 and "one checkpoint needs about" in err and "(2 planned)" in err, err
    assert no_launch == []
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(10 * needed, 9 * needed, needed))
    code, _, err = run_cli("train", "--plan", plan_path, "--steps", 4, "--checkpoint-dir", tmp_path / "c",
                           "--checkpoint-every", 2)
    assert code == 2 and "stopped at the launch" in err and no_launch == [2]  # exactly enough: launched


def test_train_refuses_a_checkpoint_dir_under_a_file(plan_path, tmp_path, no_launch):
    (tmp_path / "file").write_text("x")  # not creatable, even for root
    with pytest.raises(MeshplanError, match=r"--checkpoint-dir .*file/c cannot be created or written \(Not a directory\)"):
        train(plan_path, steps=1, out=tmp_path / "m.json", checkpoint_dir=tmp_path / "file" / "c", checkpoint_every=1)
    assert no_launch == []


# ---- measured files the report must refuse ----

def _measured(**changes):
    data = {"world_size": 2, "plan_digest": "", "step_times_s": [1.0, 0.5, 0.5], "warmup_steps": 1,
            "peak_memory_bytes_per_rank": [10, 20], "losses": [5.0, 4.0, 3.0], "tokens_per_s": 100.0}
    return {**data, **changes}


@pytest.mark.parametrize("changes,message", [
    ({"losses": None}, "losses must be a list of numbers, got None"),
    ({"world_size": "2"}, "world_size must be a whole number, got '2'"),
    ({"tokens_per_s": -5.0}, "tokens_per_s must be a finite number >= 0, got -5.0"),
    ({"step_times_s": [1.0, math.nan, 0.5]}, "step_times_s must hold finite numbers, found nan"),
    ({"losses": [5.0, math.inf, 3.0]}, "losses must hold finite numbers, found inf"),
])
def test_report_refuses_broken_measured_files(tmp_path, changes, message):
    from meshplan.planner.contracts.measurement import load_measurement

    (tmp_path / "m.json").write_text(json.dumps(_measured(**changes)))  # NaN/Infinity as Python's json writes them
    with pytest.raises(MeshplanError) as info:
        load_measurement(tmp_path / "m.json")
    assert message in str(info.value)
    (tmp_path / "ok.json").write_text(json.dumps(_measured()))
    assert load_measurement(tmp_path / "ok.json").losses == (5.0, 4.0, 3.0)


def test_hang_description_names_the_ranks_that_recorded_nothing(tmp_path):
    from meshplan.executor.launch import describe_hang

    for rank, step in ((0, 4), (1, 4), (2, 2)):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"pid": 1, "step": step, "restart": 0}))
    (tmp_path / "error_rank0.txt").write_text("RuntimeError: Timed out waiting 4000ms for recv operation\n")
    (tmp_path / "error_rank1.txt").write_text("DistBackendError: watchdog caught collective operation timeout\n")
    message = describe_hang(tmp_path)
    assert message.startswith("rank 2 (in step 3) stopped responding: ranks 0, 1 timed out")
    (tmp_path / "error_rank1.txt").write_text("RuntimeError: Connection closed by peer [127.0.0.1]:5797\n")
    assert describe_hang(tmp_path).startswith("rank 2 (in step 3) stopped responding: rank 0 timed out")
    (tmp_path / "error_rank1.txt").write_text("ValueError: bad shard\n")  # a real error, not a wait
    assert describe_hang(tmp_path) is None
    (tmp_path / "error_rank0.txt").write_text("RuntimeError: Connection reset by peer\n")  # a killed rank
    (tmp_path / "error_rank1.txt").unlink()
    assert describe_hang(tmp_path) is None
