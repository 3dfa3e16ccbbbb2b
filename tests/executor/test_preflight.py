"""`train`'s preflight: the plan's device kind, world size and predicted per-rank memory against
this machine's CPUs, RAM and GPUs, refused in one line with the plan re-made for this machine."""
from __future__ import annotations

import pytest

from meshplan.executor.plans import uniform_plan
from meshplan.executor.preflight import MAX_RANKS_PER_CPU, Machine, preflight_refusal, this_machine
from meshplan.planner.contracts.plan import save_plan
from meshplan.planner.costing.hardware import load_cluster

SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=256"
GIB = 2**30
CPU_HOST = Machine(num_cpus=2, ram_available_bytes=8 * GIB)
GPU_HOST = Machine(num_cpus=32, ram_available_bytes=512 * GIB, num_gpus=8, gpu_memory_bytes=80 * GIB,
                   gpu_name="NVIDIA H100 80GB HBM3")


def _plan(cluster: str, dp: int, peak_bytes: float, precision: str = "fp32"):
    plan = uniform_plan(SPEC, 16, 8 * dp, load_cluster(cluster), dp=dp, precision=precision)
    return plan.with_prediction({"peak_memory_bytes": peak_bytes, "step_time_s": 1.0})


def test_a_gpu_plan_on_a_machine_without_gpus_is_refused_with_the_cpu_plan_that_would_run():
    plan = _plan("h100-sxm", 4, 10 * GIB, "bf16-mixed")
    refusal = preflight_refusal(plan, 4, CPU_HOST)
    assert refusal.startswith("the plan is for 4 x H100") and "this machine has no GPU" in refusal
    assert f"meshplan plan --model {SPEC} --cluster cpu --gpus 2 --gbs 32 --seq 16" in refusal
    assert "--force" in refusal and "\n" not in refusal


def test_gpu_plans_against_this_machines_gpu_count_and_memory():
    assert preflight_refusal(_plan("h100-sxm", 8, 70 * GIB, "bf16-mixed"), 8, GPU_HOST) is None
    refusal = preflight_refusal(_plan("h100-sxm", 16, 70 * GIB, "bf16-mixed"), 16, GPU_HOST)
    assert "(16 processes) but this machine has 8 GPU(s)" in refusal and "--cluster h100-sxm --gpus 8" in refusal
    refusal = preflight_refusal(_plan("h100-sxm", 8, 90 * GIB, "bf16-mixed"), 8, GPU_HOST)
    assert "predicted at 90.0 GiB per GPU" in refusal and "holds 80.0 GiB" in refusal


def test_cpu_plans_against_this_machines_cpus_and_ram():
    assert preflight_refusal(_plan("cpu", 2, 0.5 * GIB), 2, CPU_HOST) is None
    many = 2 * MAX_RANKS_PER_CPU + 2
    refusal = preflight_refusal(_plan("cpu", many, 0.01 * GIB), many, CPU_HOST)
    assert f"{many} processes on 2 CPU(s)" in refusal and "--cluster cpu --gpus 2" in refusal
    reserved = load_cluster("cpu").device.reserved_memory_bytes
    refusal = preflight_refusal(_plan("cpu", 4, 2 * GIB), 4, CPU_HOST)
    assert f"need about {4 * (2 * GIB + reserved) / GIB:.1f} GiB" in refusal and "8.0 GiB of RAM" in refusal


def test_this_machine_is_read():
    here = this_machine()
    assert here.num_cpus >= 1 and here.ram_available_bytes > 0 and here.num_gpus >= 0


def test_train_refuses_before_launch_and_force_overrides(run_cli, no_launch, tmp_path, monkeypatch):
    from meshplan.executor import preflight

    monkeypatch.setattr(preflight, "this_machine", lambda: CPU_HOST)
    path = tmp_path / "plan.json"
    save_plan(_plan("h100-sxm", 4, 10 * GIB, "bf16-mixed"), path)
    code, out, err = run_cli("train", "--plan", path, "--steps", 1, "--out", tmp_path / "m.json")
    lines = err.strip().splitlines()
    assert code == 2 and no_launch == [] and len(lines) == 1 and "this machine has no GPU" in lines[0], err
    code, _, err = run_cli("train", "--plan", path, "--steps", 1, "--out", tmp_path / "m.json", "--force")
    assert code == 2 and "stopped at the launch" in err and no_launch == [4]


def test_an_interrupted_launch_echoes_nothing_of_the_agents_shutdown(capsys):
    """Ctrl-C in the launcher: torchrun's SignalException traceback (printed as the agent is stopped)
    stays out of the echoed output; the CLI then says `interrupted` in one line."""
    import sys
    import time

    from meshplan.executor import launch

    agent = ("import signal, sys, time\n"
             "def stop(*_):\n"
             "    print('Traceback (most recent call last):', flush=True)\n"
             "    print('torch.distributed.elastic.multiprocessing.api.SignalException: Process got signal: 15', "
             "flush=True)\n"
             "    sys.exit(1)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             "print('step 1', flush=True)\n"
             "time.sleep(60)\n")
    started = time.monotonic()

    def watch(finished: bool = False) -> None:
        if not finished and "step 1" in capsys.readouterr().out:  # echoed while running
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch._run_in_own_group([sys.executable, "-c", agent], {}, None, True, watch)
    assert time.monotonic() - started < 30
    assert "Traceback" not in capsys.readouterr().out
