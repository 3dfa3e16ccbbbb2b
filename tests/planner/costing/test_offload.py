"""Offloading model states to host memory (`costing.offload`): the states that move, the CPU step
and the transfers, the search's hook, the plan file, the engines' keys and the refusal to train."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import load_plan, plan_from_json, save_plan
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.offload import host_times_s, offloaded_state_bytes
from meshplan.planner.simulation.estimator import estimate

LLAMA_8B_PARAMS = 8_030_261_248  # llama3-8b, untied (the published count)


def _estimate(offload: str, zero: int = 1, engine: str = "meshplan"):
    return estimate("llama3-8b", "h100-sxm", gpus=8, global_batch=64, seq=2048, zero=zero, engine=engine,
                    offload=offload)


@pytest.mark.parametrize("engine", ["meshplan", "deepspeed", "megatron"])
def test_offloading_the_optimizer_moves_its_states_and_nothing_else(engine):
    kept, moved = _estimate("none", engine=engine).memory[0], _estimate("optimizer", engine=engine).memory[0]
    assert kept.optimizer > 1e9 and moved.optimizer == 0.0
    assert (moved.params, moved.grads, moved.activations, moved.buffers) == \
        (kept.params, kept.grads, kept.activations, kept.buffers)
    assert moved.total == pytest.approx(kept.total - kept.optimizer)


def test_offloading_parameters_moves_every_state_at_zero_3():
    kept, moved = _estimate("none", zero=3).memory[0], _estimate("params", zero=3).memory[0]
    assert kept.params > 0 and kept.grads > 0 and kept.optimizer > 0
    assert (moved.params, moved.grads, moved.optimizer) == (0.0, 0.0, 0.0)
    assert moved.buffers == kept.buffers  # ZeRO-3's gathered layer still lives on the device
    with pytest.raises(MeshplanError, match="needs them sharded, ZeRO-3"):
        _estimate("params", zero=1)


def test_the_memory_rule_is_one_function():
    assert offloaded_state_bytes(2.0, 4.0, 12.0, "optimizer") == {
        "param_bytes": 2.0, "grad_bytes": 4.0, "optimizer_bytes": 0.0, "host": 12.0}
    assert offloaded_state_bytes(2.0, 4.0, 12.0, "params") == {
        "param_bytes": 0.0, "grad_bytes": 0.0, "optimizer_bytes": 0.0, "host": 18.0}
    assert offloaded_state_bytes(2.0, 4.0, 12.0, "none")["host"] == 0.0


def test_host_times_are_the_cpu_adam_step_and_the_pcie_copies():
    cluster = load_cluster("h100-sxm")
    config = ParallelConfig(gpus=8, global_batch=8, dp=8, zero=1, offload="optimizer")
    owned = 1e9
    # Adam streams 28 B/param (the profile's figure) at a 1/8 share of DGX H100's 614.4 GB/s host
    # DRAM, instead of at the GPU's 3.35 TB/s x 0.85; bf16 parameters come back over PCIe Gen5
    # x16 (64 GB/s); the bf16 gradients' copy down (64 GB/s) hides behind a 1 s backward.
    cpu_s = owned * 28 / (614.4e9 / 8) - owned * 28 / (3.35e12 * cluster.device.memory_efficiency)
    up_s = owned * 2 / 64e9
    times = host_times_s(owned, 1.0, config, cluster)
    assert times == pytest.approx({"step_s": cpu_s + up_s, "pass_s": 0.0})
    assert cluster.optimizer_bytes_per_param == 28.0 and 0.38 < times["step_s"] < 0.39
    # without a backward to hide behind, the gradients' copy is exposed too: ZeRO-Offload's 4M bytes
    exposed = host_times_s(owned, 0.0, config, cluster)["step_s"] - cpu_s
    assert exposed * 64e9 == pytest.approx(4 * owned)
    params = host_times_s(owned, 1.0, replace(config, zero=3, offload="params"), cluster)
    assert params == pytest.approx({"step_s": cpu_s, "pass_s": up_s})  # the shard goes up every pass


def test_the_step_pays_the_host_step_and_the_upload():
    slow, fast = _estimate("optimizer"), _estimate("none")
    owned = LLAMA_8B_PARAMS / 8
    cpu_s = owned * 28 / (614.4e9 / 8) - owned * 28 / (3.35e12 * load_cluster("h100-sxm").device.memory_efficiency)
    added = slow.breakdown["optimizer"] - fast.breakdown["optimizer"]
    # at least the CPU step and the parameters' copy up, at most also every gradient's copy down
    assert cpu_s + owned * 2 / 64e9 <= added <= cpu_s + owned * 4 / 64e9
    assert slow.step_time_s == pytest.approx(fast.step_time_s + added, rel=1e-6)


def test_a_profile_without_host_bandwidths_refuses_offloading():
    with pytest.raises(MeshplanError, match="offloading moves nothing"):
        estimate("gpt2", "cpu", gpus=2, global_batch=4, seq=128, zero=1, offload="optimizer")


@pytest.fixture(scope="module")
def offloaded_plan():
    from meshplan.planner.search.driver import search_plan

    # 8B on two 40 GB GPUs: 64.6 GiB at the leanest on the devices alone
    return search_plan("llama3-8b", "a100-40g", 2, 2, seq=1024, tp=1, pp=1, top_k=1)


def test_the_search_offloads_only_when_nothing_fits_and_says_so(offloaded_plan):
    from meshplan.planner.search.driver import search_plan

    assert offloaded_plan.config.offload == "optimizer"
    assert offloaded_plan.prediction["fits"]
    assert offloaded_plan.solver["offload"].startswith("nothing fits on the GPUs without offloading")
    assert not offloaded_plan.executable and "planned, not executed" in offloaded_plan.not_executable_reason
    roomy = search_plan("llama3-8b", "a100-40g", 4, 4, seq=1024, tp=1, pp=1, top_k=1)
    assert roomy.config.offload == "none" and "offload" not in roomy.solver
    pinned = search_plan("llama3-8b", "a100-40g", 4, 4, seq=1024, tp=1, pp=1, top_k=1, offload="optimizer")
    assert pinned.config.offload == "optimizer" and "offload" not in pinned.solver
    assert pinned.prediction["step_time_s"] > roomy.prediction["step_time_s"]


def test_the_plan_file_keeps_the_offload_key(offloaded_plan, tmp_path):
    data = offloaded_plan.to_json()
    assert data["offload"] == "optimizer"
    path = tmp_path / "plan.json"
    save_plan(offloaded_plan, path)
    assert load_plan(path).config.offload == "optimizer"
    older = {k: v for k, v in data.items() if k != "offload"}  # plans without the key offload nothing
    assert plan_from_json(older).config.offload == "none"
    assert plan_from_json(older).digest != offloaded_plan.digest


def test_the_engines_export_and_read_back_offloading(offloaded_plan):
    from meshplan.planner.engines.bridge import export_plan, read_engine_text

    deepspeed = json.loads(export_plan(offloaded_plan, "deepspeed").text)
    assert deepspeed["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in deepspeed["zero_optimization"]
    megatron = export_plan(offloaded_plan, "megatron").text
    assert "--optimizer-cpu-offload" in megatron and "--optimizer-offload-fraction 1.0" in megatron
    torchtitan = export_plan(offloaded_plan, "torchtitan")
    assert "enable_cpu_offload = true" in torchtitan.text
    assert any("CPUOffloadPolicy" in note for note in torchtitan.notes)
    for engine in ("deepspeed", "megatron"):
        assert read_engine_text(export_plan(offloaded_plan, engine).text, engine).offload == "optimizer"
    params = replace(offloaded_plan, config=replace(offloaded_plan.config, offload="params"))
    ds_params = json.loads(export_plan(params, "deepspeed").text)["zero_optimization"]
    assert ds_params["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert read_engine_text(json.dumps({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
                                         "zero_optimization": ds_params}), "deepspeed").offload == "params"
    assert read_engine_text(export_plan(params, "torchtitan").text, "torchtitan").offload == "params"


def test_train_refuses_an_offload_plan_on_cpu(tmp_path):
    from meshplan.executor.checks import check_plan_runnable
    from meshplan.planner.costing.executable import model_facts, why_not_executable
    from meshplan.planner.profiling.profiler import profile

    config = ParallelConfig(gpus=2, global_batch=4, dp=2, zero=1, precision="fp32", offload="optimizer")
    reason = why_not_executable(config, model_facts(profile("gpt2", 128, dtype="fp32")))
    assert reason.startswith("offloading (optimizer) is planned, not executed") and "\n" not in reason
    assert "on the cpu cluster the device is the host" in reason
    from meshplan.planner.search.driver import search_plan

    plan = search_plan("gpt:layers=2,hidden=64,heads=4,vocab=256", "cpu", 2, 4, seq=32, top_k=1, zero=1)
    assert plan.executable
    marked = replace(plan, config=replace(plan.config, offload="optimizer"), executable=False,
                     not_executable_reason=why_not_executable(replace(plan.config, offload="optimizer"),
                                                              model_facts(profile("gpt:layers=2,hidden=64,heads=4,"
                                                                                  "vocab=256", 32, dtype="fp32"))))
    with pytest.raises(MeshplanError, match="offloading .optimizer. is planned, not executed"):
        check_plan_runnable(marked, 2)
