"""`meshplan train` end to end: resume after a killed worker, failures naming the rank, refusals."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.process_helpers import process_alive

from meshplan.executor import train
from meshplan.executor.launch import TrainingFailed
from meshplan.executor.plans import uniform_plan
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.contracts.plan import save_plan

# Big enough that a step takes a visible fraction of a second on one core, so the test can kill
# a worker between two steps; small enough to start quickly.
RESUME_SPEC = "gpt:layers=2,hidden=128,heads=4,vocab=256"
MEASURED_KEYS = {"world_size", "plan_digest", "step_times_s", "warmup_steps", "peak_memory_bytes_per_rank",
                 "losses", "tokens_per_s", "host", "versions"}


def _kill_when(run_dir, rank: int, at_step: int, killed: dict, timeout_s: float = 300) -> threading.Thread:
    """Watch rank `rank`'s heartbeat and SIGKILL that worker once it has completed `at_step` steps."""

    def watch():
        deadline = time.monotonic() + timeout_s
        path = run_dir / f"rank{rank}.json"
        while time.monotonic() < deadline:
            try:
                beat = json.loads(path.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                beat = None
            if beat and beat["restart"] == 0 and beat["step"] >= at_step:
                os.kill(beat["pid"], signal.SIGKILL)
                killed.update(beat)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=4, shard_group=2), dict(cp=2)],
                         ids=["zero3", "hsdp-2x2", "cp2"])
def test_killed_worker_restarts_and_resumes_with_identical_losses(tmp_path, layout):
    plan = uniform_plan(RESUME_SPEC, 64, 8, load_cluster("cpu"), microbatch_size=2, zero=3,
                        seed=5, **layout)
    save_plan(plan, tmp_path / "plan.json")
    clean = train(tmp_path / "plan.json", steps=10, out=tmp_path / "clean.json", run_dir=tmp_path / "clean")

    killed: dict = {}
    watcher = _kill_when(tmp_path / "run", rank=1, at_step=5, killed=killed)
    resumed = train(tmp_path / "plan.json", steps=10, out=tmp_path / "resumed.json", run_dir=tmp_path / "run",
                    checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, max_restarts=1)
    watcher.join(timeout=5)
    assert killed, "the watcher never saw rank 1 reach step 5"
    assert json.loads((tmp_path / "run" / "rank1.json").read_text())["restart"] == 1
    assert resumed.resumed_from_step in (4, 6, 8) and resumed.resumed_from_step <= killed["step"]
    assert len(resumed.losses) == 10
    # Same weights, data and optimizer state restored exactly by DCP: the same arithmetic runs
    # again, so losses agree to float32 rounding (1e-6 relative allows a reordered reduction).
    for step, (got, expected) in enumerate(zip(resumed.losses, clean.losses), start=1):
        assert got == pytest.approx(expected, rel=1e-6), f"step {step}"
    markers = sorted(p.parent.name for p in (tmp_path / "ckpt").glob("step_*/COMPLETE"))
    assert markers == ["step_10", "step_2", "step_4", "step_6", "step_8"]


def _cpu_profile_for(tmp_path, num_processes: int):
    """The cpu profile with enough (virtual) nodes for `num_processes` local processes."""
    from dataclasses import replace

    from meshplan.planner.contracts.cluster import dump_cluster_toml

    cpu = load_cluster("cpu")
    nodes = -(-num_processes // cpu.gpus_per_node)
    path = tmp_path / "cpu.toml"
    path.write_text(dump_cluster_toml(replace(cpu, max_nodes=max(cpu.max_nodes, nodes))))
    return path


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_processes,pins", [(2, ["--pp", "2", "--schedule", "gpipe"]),
                                                (4, ["--tp", "2", "--dp", "2", "--zero", "1"])])
def test_meshplan_plan_then_train(tmp_path, run_cli, num_processes, pins):
    cluster = _cpu_profile_for(tmp_path, num_processes)
    code, _, err = run_cli("plan", "--model", "gpt:layers=2,hidden=32,heads=2,vocab=256", "--seq", 16,
                           "--cluster", cluster, "--gpus", num_processes, "--gbs", 4, *pins,
                           "--out", tmp_path / "plan.json")
    assert code == 0, err
    code, out, err = run_cli("train", "--plan", tmp_path / "plan.json", "--steps", 4, "--out", tmp_path / "m.json")
    assert code == 0, err
    measured = json.loads((tmp_path / "m.json").read_text())
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert MEASURED_KEYS <= set(measured)
    assert measured["world_size"] == num_processes
    assert len(measured["losses"]) == len(measured["step_times_s"]) == 4
    assert len(measured["peak_memory_bytes_per_rank"]) == num_processes
    assert all(value > 0 for value in measured["peak_memory_bytes_per_rank"])
    # tokens/s over the timed steps: global batch x sequence length per step
    timed = measured["step_times_s"][measured["warmup_steps"]:]
    tokens_per_step = plan["global_batch"] * plan["model"]["seq"]
    assert measured["tokens_per_s"] == pytest.approx(tokens_per_step * len(timed) / sum(timed), rel=1e-9)
    from meshplan.planner.contracts.plan import load_plan

    assert measured["plan_digest"] == load_plan(tmp_path / "plan.json").digest


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_a_killed_rank_is_named_and_no_worker_survives(tmp_path):
    plan = uniform_plan("gpt:layers=2,hidden=32,heads=2,vocab=256", 16, 4, load_cluster("cpu"), dp=2,
                        microbatch_size=2, seed=1)
    killed: dict = {}
    watcher = _kill_when(tmp_path / "failing", rank=1, at_step=1, killed=killed)
    with pytest.raises(TrainingFailed, match=r"rank 1 failed \(killed by SIGKILL\)"):
        train(plan, steps=2000, out=tmp_path / "never.json", run_dir=tmp_path / "failing")
    watcher.join(timeout=5)
    assert killed
    beat = json.loads((tmp_path / "failing" / "rank0.json").read_text())
    with pytest.raises(ProcessLookupError):  # no worker outlives a failed run
        os.kill(beat["pid"], 0)
    assert not (tmp_path / "never.json").exists()


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_workers_exit_by_themselves_when_the_torchrun_agent_dies(tmp_path):
    import subprocess

    from meshplan.executor.launch import free_port, torchrun_command

    plan = uniform_plan("gpt:layers=2,hidden=32,heads=2,vocab=256", 16, 4, load_cluster("cpu"), dp=2,
                        microbatch_size=2, seed=1)
    save_plan(plan, tmp_path / "plan.json")
    run_dir = tmp_path / "run"
    command = torchrun_command(2, 0, ["--plan", str(tmp_path / "plan.json"), "--steps", "100000", "--out",
                                      str(tmp_path / "m.json"), "--run-dir", str(run_dir)], free_port())
    agent = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    try:
        deadline = time.monotonic() + 150
        pids = []
        while time.monotonic() < deadline and len(pids) < 2:
            try:
                pids = [json.loads((run_dir / f"rank{r}.json").read_text())["pid"] for r in range(2)]
            except (FileNotFoundError, json.JSONDecodeError):
                time.sleep(0.05)
        assert len(pids) == 2, "workers never reported a step"
        agent.kill()  # SIGKILL: the agent cannot clean up after itself
        agent.wait()
        deadline = time.monotonic() + 15  # workers poll their parent every second
        while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(process_alive(pid) for pid in pids), "a worker outlived its torchrun agent"
    finally:
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
