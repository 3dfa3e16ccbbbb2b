"""Checkpoints meshplan can trust, the loopback rendezvous, and SIGTERM.

In-process tests cover the manifest (run identity, SHA-256 of every file), its verification
(never unpickling `.metadata` before its hash matches), the choice of the checkpoint to resume
from, and the loopback-only stores. A few real launches (2 gloo ranks, 3 steps of a tiny GPT)
check the same through `train`: a corrupted checkpoint falls back, another run's checkpoint is
not adopted on a restart, a non-finite state is never marked complete, and SIGTERM stops
everything with exit 143, the rendezvous stores having listened on 127.0.0.1 only.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from datetime import timedelta
from pathlib import Path

import pytest

from tests.process_helpers import process_alive

from meshplan.executor import manifest as mf
from meshplan.executor import train
from meshplan.executor.launch import TrainingFailed
from meshplan.executor.plans import uniform_plan
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import load_plan, save_plan
from meshplan.planner.costing.hardware import load_cluster

SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=256"
STEPS = 3


class _TouchOnLoad:
    """A pickle whose loading creates a file: what a hostile `.metadata` could do instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _fake_checkpoint(directory: Path, step: int, identity: mf.RunIdentity) -> Path:
    """A checkpoint with a manifest over made-up files (verification reads bytes, never unpickles)."""
    path = directory / f"step_{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata %d" % step)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    mf.write_manifest(path, mf.Manifest(step=step, world_size=2, identity=identity, files=mf.describe_files(path)))
    return path


IDENTITY = mf.RunIdentity(run_id="run-a", plan_digest="p1", seed=3, model_digest="m1")


def _flip_bytes(path: Path, offset: int = 64, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for index in range(offset, min(offset + count, len(data))):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verification_catches_altered_truncated_and_missing_files_without_unpickling(tmp_path):
    good = _fake_checkpoint(tmp_path, 1, IDENTITY)
    assert mf.verify(good).step == 1
    flipped = _fake_checkpoint(tmp_path, 2, IDENTITY)
    _flip_bytes(flipped / "__0_0.distcp")
    with pytest.raises(mf.CheckpointInvalid, match=r"^the SHA-256 of __0_0.distcp differs from its manifest$"):
        mf.verify(flipped)
    truncated = _fake_checkpoint(tmp_path, 3, IDENTITY)
    (truncated / "__0_0.distcp").write_bytes(b"short")
    with pytest.raises(mf.CheckpointInvalid, match=r"__0_0.distcp holds 5 bytes, its manifest says 1024"):
        mf.verify(truncated)
    missing = _fake_checkpoint(tmp_path, 4, IDENTITY)
    (missing / "__0_0.distcp").unlink()
    with pytest.raises(mf.CheckpointInvalid, match=r"__0_0.distcp cannot be read \(No such file or directory\)"):
        mf.verify(missing)
    hostile = _fake_checkpoint(tmp_path, 5, IDENTITY)
    touched = tmp_path / "code-ran"
    (hostile / ".metadata").write_bytes(pickle.dumps(_TouchOnLoad(touched)))
    broken_manifest = _fake_checkpoint(tmp_path, 6, IDENTITY)
    (broken_manifest / mf.MARKER).write_text('{"manifest_version": 1, "step": "6"')
    choice = mf.newest_verified(mf.checkpoints(tmp_path))
    assert choice.path == good and not touched.exists()
    assert [note.split(": ", 1)[0] for note in choice.notes] == [
        f"checkpoint {tmp_path / f'step_{step}'} is not used" for step in (6, 5, 4, 3, 2)]
    assert re.search(r"step_5 is not used: \.metadata holds \d+ bytes, its manifest says 10$", choice.notes[1])
    assert "is not a valid manifest" in choice.notes[0]


def test_resume_refuses_another_runs_checkpoint_and_restarts_adopt_only_their_own(tmp_path):
    _fake_checkpoint(tmp_path, 2, IDENTITY)
    other = mf.RunIdentity(run_id="run-b", plan_digest="p1", seed=5, model_digest="m1")
    _fake_checkpoint(tmp_path, 4, other)
    with pytest.raises(mf.OtherRunsCheckpoint, match=r"step_4, was written by another run \(seed 5, this run 3\); "
                                                     r"to start from it anyway pass --resume-from .*step_4"):
        mf.choose_for_resume(tmp_path, IDENTITY)
    assert mf.choose_for_resume(tmp_path, other).manifest.identity.run_id == "run-b"
    assert mf.choose_for_restart(tmp_path, "run-a").path == tmp_path / "step_2"  # never run-b's newer step_4
    assert mf.choose_for_restart(tmp_path, "run-c").path is None
    assert mf.choose_explicit(tmp_path / "step_4").manifest.identity == other
    _flip_bytes(tmp_path / "step_4" / "__0_0.distcp")
    with pytest.raises(mf.CheckpointInvalid, match=r"step_4 is not used: the SHA-256 of __0_0.distcp differs"):
        mf.choose_explicit(tmp_path / "step_4")


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    save_plan(uniform_plan(SPEC, 16, 4, load_cluster("cpu"), dp=2, microbatch_size=2, seed=3), path)
    return path


def _identity_of(plan_path, seed: int, run_id: str) -> mf.RunIdentity:
    from meshplan.executor.checkpoint import run_identity

    return run_identity(load_plan(plan_path), seed, run_id)


def test_train_refuses_before_launch_another_runs_checkpoint_and_fewer_steps_than_done(plan_path, tmp_path,
                                                                                       no_launch, run_cli):
    ckpt = tmp_path / "ckpt"
    _fake_checkpoint(ckpt, 200, _identity_of(plan_path, 5, "other"))
    code, _, err = run_cli("train", "--plan", plan_path, "--steps", 300, "--checkpoint-dir", ckpt, "--resume")
    assert code == 2 and "was written by another run (seed 5, this run 3)" in err and "--resume-from" in err, err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_cli("train", "--plan", plan_path, "--steps", 100, "--checkpoint-dir", ckpt, "--resume",
                           "--seed", 5, "--out", tmp_path / "m.json")
    assert code == 2 and err.strip().endswith(
        f"checkpoint {ckpt.resolve() / 'step_200'} has already trained 200 steps and --steps 100 asks for fewer: "
        "nothing to train or measure; ask for --steps above 200"), err
    assert no_launch == [] and not (tmp_path / "m.json").exists()
    code, _, err = run_cli("train", "--plan", plan_path, "--steps", 300, "--resume-from", ckpt / "step_200")
    assert code == 2 and "stopped at the launch" in err and no_launch == [2]  # named explicitly: accepted


def test_a_full_disk_under_torchs_writer_names_the_os_reason(tmp_path, monkeypatch):
    from meshplan.executor import checkpoint

    usage = namedtuple("usage", "total used free")
    enforce = RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(100, 100, 0))
    message = checkpoint._save_failure(tmp_path / "step_4", 4, enforce, "run-a")
    assert message.startswith(f"saving checkpoint step_4 to {tmp_path / 'step_4'} failed (No space left on device); "
                              "no earlier complete checkpoint exists")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(100, 0, 100 << 20))
    assert "(RuntimeError: [enforce fail" in checkpoint._save_failure(tmp_path / "step_4", 4, enforce, "run-a")


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net shows them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


LOOPBACK_HEX = "0100007F"  # 127.0.0.1 in /proc/net/tcp


def test_the_rendezvous_stores_listen_on_loopback_only(monkeypatch):
    import torch.distributed as dist

    from meshplan.executor.loopback import tcp_store, worker_store

    plain = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
    assert LOOPBACK_HEX not in _listening(plain.port)  # torch's own: every interface despite the host
    agent = tcp_store("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10))
    assert _listening(agent.port) == [LOOPBACK_HEX]
    agent.set("key", "value")
    client = dist.TCPStore("127.0.0.1", agent.port, is_master=False, timeout=timedelta(seconds=10))
    assert client.get("key") == b"value"
    from meshplan.executor.launch import free_port

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    arguments = worker_store(timedelta(seconds=10))
    assert arguments["rank"] == 0 and arguments["world_size"] == 1
    assert _listening(port) == [LOOPBACK_HEX]
    monkeypatch.setenv("MASTER_ADDR", "node0.example")  # multi-node: torch's own store
    assert worker_store(timedelta(seconds=10)) == {}


# ---- real launches ----

def _complete(directory: Path) -> list[int]:
    return sorted(int(path.parent.name[5:]) for path in directory.glob("step_*/COMPLETE"))


def _same_losses(got, expected):
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        assert a == pytest.approx(b, rel=1e-6), f"step {step}"


@pytest.fixture(scope="module")
def saved(plan_path, tmp_path_factory):
    """A clean run saving every step: its losses, and a pristine copy of its checkpoints."""
    root = tmp_path_factory.mktemp("saved")
    measured = train(plan_path, steps=STEPS, out=root / "m.json", run_dir=root / "run", checkpoint_dir=root / "ckpt",
                     checkpoint_every=1)
    return measured, root / "ckpt"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_corrupt_checkpoint_falls_back_to_the_newest_that_verifies(plan_path, saved, tmp_path, capsys):
    measured, pristine = saved
    on_disk = sum(path.stat().st_size for path in (pristine / "step_3").iterdir())
    from meshplan.executor.checkpoint import estimated_size_bytes

    assert estimated_size_bytes(SPEC, 16, 2) == pytest.approx(on_disk, rel=0.05)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    touched = tmp_path / "code-ran"
    (ckpt / "step_3" / ".metadata").write_bytes(pickle.dumps(_TouchOnLoad(touched)))
    _flip_bytes(next((ckpt / "step_2").glob("__0_*.distcp")))
    resumed = train(plan_path, steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run", checkpoint_dir=ckpt,
                    resume=True)
    assert not touched.exists()  # the hostile .metadata was never unpickled, on any rank
    assert resumed.resumed_from_step == 1
    _same_losses(resumed.losses, measured.losses)
    err = capsys.readouterr().err
    assert f"checkpoint {ckpt / 'step_3'} is not used: .metadata holds" in err
    assert f"checkpoint {ckpt / 'step_2'} is not used: the SHA-256 of __0_0.distcp differs from its manifest" in err


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_restart_never_adopts_another_runs_checkpoint(plan_path, saved, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[1], ckpt)  # another run's step_1..3 (seed 3)
    monkeypatch.setenv("MESHPLAN_FAULT", "kill_in_save:rank=1,step=2")
    fresh = train(plan_path, steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run", checkpoint_dir=ckpt,
                  checkpoint_every=2, max_restarts=1, seed=5)
    assert json.loads((tmp_path / "run" / "rank1.json").read_text())["restart"] == 1
    assert fresh.resumed_from_step == 0 and len(fresh.losses) == STEPS  # not "after step 3" of the other run
    assert fresh.losses[0] != pytest.approx(saved[0].losses[0], rel=1e-6)  # seed 5's data, not seed 3's
    assert mf.read_manifest(ckpt / "step_2").identity.seed == 5
    assert mf.read_manifest(ckpt / "step_3").identity.seed == 3


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_non_finite_state_is_never_marked_complete(plan_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_FAULT", "nan_in_save:rank=0,step=2")
    ckpt = tmp_path / "ckpt"
    with pytest.raises(TrainingFailed, match=r"the weights or optimizer state after step 2 hold NaN or infinite "
                                             r"values: checkpoint .*step_2 was not marked complete; the newest "
                                             r"complete checkpoint, .*step_1, is intact"):
        train(plan_path, steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run", checkpoint_dir=ckpt,
              checkpoint_every=1, max_restarts=1)
    assert _complete(ckpt) == [1]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_dp_checkpoint_of_a_tied_embedding_model_resumes_as_pp(saved, tmp_path):
    # dp holds the tied embedding and head as one parameter, whose optimizer state is saved once
    # under the embedding's name; pp's last stage holds the head alone and asks for it by its name.
    measured, ckpt = saved
    plan = uniform_plan(SPEC, 16, 4, load_cluster("cpu"), pp=2, microbatch_size=2, seed=3)
    save_plan(plan, tmp_path / "pp.json")
    resumed = train(tmp_path / "pp.json", steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run",
                    resume_from=ckpt / "step_2")
    assert resumed.resumed_from_step == 2
    _same_losses(resumed.losses, measured.losses)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_checkpoint_that_does_not_fit_the_model_fails_in_one_line(saved, tmp_path):
    plan = uniform_plan("gpt:layers=2,hidden=48,heads=2,vocab=256", 16, 4, load_cluster("cpu"), dp=2,
                        microbatch_size=2, seed=3)
    save_plan(plan, tmp_path / "wider.json")
    with pytest.raises(TrainingFailed) as info:  # restarts cannot cure it: the first failure is the last
        train(tmp_path / "wider.json", steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run",
              resume_from=saved[1] / "step_2", max_restarts=1)
    message = str(info.value)
    assert re.search(r"CheckpointLoadFailed: loading checkpoint .*step_2 failed \(ValueError: Size mismatch between "
                     r"saved torch.Size\(\[256, 32\]\) and current: torch.Size\(\[256, 48\]\)", message), message
    assert len(message.splitlines()) == 1 and len(message) < 700, message
    assert json.loads((tmp_path / "run" / "rank0.json").read_text())["restart"] == 1  # stopped at once on restart


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _listening_addresses(pids: list[int]) -> list[str]:
    """Local addresses of the IPv4/IPv6 sockets these processes listen on."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(fields[1].rsplit(":", 1)[0])
    return found


def _hung_train(plan_path, tmp_path):
    """`meshplan train` (the CLI, a process of its own) with rank 0 stuck before step 2:
    (process, its TMPDIR, the torchrun agent's pids, the workers' pids)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = dict(os.environ, TMPDIR=str(temporary), OMP_NUM_THREADS="1", MESHPLAN_FAULT="hang:rank=0,step=2")
    process = subprocess.Popen([sys.executable, "-m", "meshplan.cli", "train", "--plan", str(plan_path), "--steps", "3",
                                "--out", str(tmp_path / "m.json")], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 200
    beats = []
    while time.monotonic() < deadline and process.poll() is None:  # until both ranks did step 1
        beats = list(temporary.glob("meshplan-train-*/rank*.json"))
        if len(beats) == 2 and all(json.loads(b.read_text() or "{}").get("step") == 1 for b in beats):
            break
        time.sleep(0.5)
    workers = [json.loads(beat.read_text())["pid"] for beat in beats]
    agents = _children(process.pid)
    if len(workers) != 2 or not agents:
        process.kill()
        pytest.fail(f"the run did not reach step 1 (exit {process.poll()})")
    return process, temporary, agents, workers


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_sigterm_stops_the_workers_and_cleans_up_and_the_stores_listened_on_loopback(plan_path, tmp_path):
    process, temporary, agents, workers = _hung_train(plan_path, tmp_path)
    try:
        addresses = _listening_addresses(agents + workers)
        # the agent's store, rank 0's store and gloo's pairs: nothing on another interface
        assert len(addresses) >= 2 and set(addresses) == {LOOPBACK_HEX}, addresses
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, err
    assert err.strip().splitlines()[-1] == "meshplan train: terminated (SIGTERM); the workers were stopped"
    assert not [pid for pid in agents + workers if process_alive(pid)]
    assert list(temporary.glob("meshplan-train-*")) == []


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_killed_launcher_takes_the_agent_and_the_workers_with_it(plan_path, tmp_path):
    process, _, agents, workers = _hung_train(plan_path, tmp_path)
    process.kill()  # SIGKILL: no cleanup of its own can run
    process.communicate(timeout=30)
    deadline = time.monotonic() + 30  # the agent's SIGTERM stops the workers within its grace period
    while time.monotonic() < deadline and [pid for pid in agents + workers if process_alive(pid)]:
        time.sleep(0.5)
    assert not [pid for pid in agents + workers if process_alive(pid)]
