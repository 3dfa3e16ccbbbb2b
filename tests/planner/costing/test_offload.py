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
    # 8B's fp32 Adam moments (8 bytes per parameter) over the two GPUs of one node: well inside its host
    assert offloaded_plan.prediction["host_state_bytes_per_node"] == pytest.approx(8 * LLAMA_8B_PARAMS, rel=1e-3)
    assert offloaded_plan.solver["num_pruned_host_memory"] == 0
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


# Offloaded states against the host's memory (`costing.offload.host_state_bytes_per_node`, `host_fits`).

SMALL = "llama:layers=4,hidden=512,heads=8,kv_heads=8,ffn=1024,vocab=1000"
GPU_PROFILES = ("a100-40g", "a100-80g", "h100-sxm", "h200", "b200", "gb200-nvl72", "h100-nvl", "h100-96g-500w",
                "mi300x")


def _with_host_memory(name: str, host_memory_bytes: float):
    cluster = load_cluster(name)
    return replace(cluster, device=replace(cluster.device, host_memory_bytes=host_memory_bytes))


def test_every_gpu_profile_describes_its_nodes_host_memory():
    from meshplan.planner.costing.offload import HOST_RESERVED_BYTES_PER_GPU, usable_host_memory_bytes

    expected = {"a100-40g": 1e12, "a100-80g": 2e12, "h100-sxm": 2e12, "h200": 2e12, "b200": 4e12,
                "gb200-nvl72": 72 * 240e9, "h100-nvl": 2e12, "h100-96g-500w": 2e12, "mi300x": 24 * 64e9}
    for name in GPU_PROFILES:
        cluster = load_cluster(name)
        assert cluster.device.host_memory_bytes == pytest.approx(expected[name]), name
        assert usable_host_memory_bytes(cluster) == pytest.approx(
            expected[name] - cluster.gpus_per_node * HOST_RESERVED_BYTES_PER_GPU)
    assert load_cluster("cpu").device.host_memory_bytes == 0.0
    # DGX A100 40GB: 1 TB less 8 x 32 GiB for the processes and data loaders
    assert usable_host_memory_bytes(load_cluster("a100-40g")) == pytest.approx(1e12 - 8 * 32 * 2**30)


def test_an_older_plan_without_host_memory_still_simulates(offloaded_plan):
    """Profiles embedded before `host_memory_bytes` existed: the host is not checked (inf)."""
    from meshplan.planner.costing.offload import usable_host_memory_bytes
    from meshplan.planner.simulation.simulator import simulate

    data = offloaded_plan.to_json()
    del data["cluster"]["embedded"]["device"]["host_memory_bytes"]
    older = plan_from_json(data)
    assert older.cluster.device.host_memory_bytes == 0.0 and usable_host_memory_bytes(older.cluster) == float("inf")
    prediction = simulate(older)
    assert prediction.fits and prediction.host_state_bytes_per_node > 0


def test_the_node_sum_follows_the_pipeline_major_rank_order():
    from meshplan.planner.costing.offload import host_state_bytes_per_node

    # two stages of 4 GPUs: one per 4-GPU node, both on one 8-GPU node
    assert host_state_bytes_per_node([3.0, 5.0], gpus=8, gpus_per_node=4) == 4 * 5.0
    assert host_state_bytes_per_node([3.0, 5.0], gpus=8, gpus_per_node=8) == 4 * 3.0 + 4 * 5.0
    # a 3-GPU node across a stage boundary: GPUs 0, 1 (stage 0) and 2 (stage 1); then GPU 3
    assert host_state_bytes_per_node([1.0, 10.0], gpus=4, gpus_per_node=3) == 2 * 1.0 + 10.0
    # a job smaller than a node: its GPUs alone
    assert host_state_bytes_per_node([7.0], gpus=2, gpus_per_node=8) == 14.0
    assert host_state_bytes_per_node([0.0, 0.0], gpus=4, gpus_per_node=8) == 0.0
    with pytest.raises(ValueError, match="6 GPUs do not split into 4 pipeline stages"):
        host_state_bytes_per_node([1.0] * 4, gpus=6, gpus_per_node=8)


def test_the_host_bytes_per_node_of_a_worked_plan():
    # llama3-8b on 16 H100s, pp=2: each pipeline stage is one 8-GPU node, whose 8 GPUs each send
    # the optimizer states they held on the device to the host; the heavier stage's node counts
    kept = estimate("llama3-8b", "h100-sxm", gpus=16, global_batch=64, seq=2048, pp=2, zero=1)
    moved = estimate("llama3-8b", "h100-sxm", gpus=16, global_batch=64, seq=2048, pp=2, zero=1, offload="optimizer")
    assert kept.host_state_bytes_per_node == 0.0 and "host_state_bytes_per_node" not in kept.to_json()
    by_stage = [8 * m.optimizer for m in kept.memory]
    assert by_stage[0] != pytest.approx(by_stage[1])  # the stages differ (the embedding, the head)
    assert moved.host_state_bytes_per_node == pytest.approx(max(by_stage), rel=1e-9)
    assert moved.to_json()["host_state_bytes_per_node"] == moved.host_state_bytes_per_node
    # on one node: all 8 GPUs' fp32 Adam moments (executor recipe: 8 bytes per parameter / dp)
    one_node = _estimate("optimizer")
    assert one_node.host_state_bytes_per_node == pytest.approx(8 * LLAMA_8B_PARAMS)


def test_estimate_simulate_and_the_search_share_one_host_rule(run_cli, tmp_path):
    """One cluster just above and one just below the worked job's host need: estimate, simulate
    (of the plan the search made) and the search's pruning all flip together."""
    from meshplan.planner.costing.offload import HOST_RESERVED_BYTES_PER_GPU
    from meshplan.planner.search.driver import search_plan
    from meshplan.planner.simulation.simulator import simulate

    job = dict(gpus=2, global_batch=4, seq=128, zero=1, offload="optimizer")
    need = estimate(SMALL, "a100-40g", **job).host_state_bytes_per_node
    assert need > 0
    reserve = 8 * HOST_RESERVED_BYTES_PER_GPU
    roomy, tight = _with_host_memory("a100-40g", reserve + need * 1.001), _with_host_memory("a100-40g", reserve + need * 0.999)
    assert estimate(SMALL, roomy, **job).fits and not estimate(SMALL, tight, **job).fits
    plan = search_plan(SMALL, roomy, 2, 4, seq=128, tp=1, pp=1, zero=1, mbs=1, recompute="none", top_k=1,
                       offload="optimizer")
    assert plan.prediction["fits"] and plan.prediction["host_state_bytes_per_node"] == pytest.approx(need)
    assert plan.solver["num_pruned_host_memory"] == 0
    assert simulate(plan).fits
    assert not simulate(replace(plan, cluster=tight)).fits
    save_plan(replace(plan, cluster=tight), tmp_path / "plan.json")
    code, out, _ = run_cli("simulate", "--plan", tmp_path / "plan.json")
    assert code == 0 and "fits: NO" in out
    assert f"host memory: {need / 2**30:.2f} GiB of offloaded states on the busiest node, " \
           f"{need * 0.999 / 2**30:.2f} GiB usable" in out
    with pytest.raises(MeshplanError, match="fits: 1 candidate.s. fit on the GPUs only by offloading more model "
                       "states than their nodes' host memory holds") as refused:
        search_plan(SMALL, tight, 2, 4, seq=128, tp=1, pp=1, zero=1, mbs=1, recompute="none", top_k=1,
                    offload="optimizer")
    assert f"the leanest {need / 2**30:.1f} GiB on a node, {need * 0.999 / 2**30:.1f} GiB usable" in str(refused.value)


def test_the_search_prunes_and_counts_candidates_the_host_cannot_hold():
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing.offload import HOST_RESERVED_BYTES_PER_GPU
    from meshplan.planner.costing.tables import build_cost_table
    from meshplan.planner.profiling.profiler import profile
    from meshplan.planner.search.offloading import least_host_bytes_per_node, prune_host_memory
    from meshplan.planner.search.solving import Solved

    graph = profile(SMALL, 128)
    cluster = load_cluster("a100-40g")
    config = ParallelConfig(gpus=2, global_batch=4, dp=2, zero=1, offload="optimizer")
    table = build_cost_table(graph, cluster, config, ("none",))
    # one node, one stage: both GPUs' offloaded states, as the simulator sums them
    need = least_host_bytes_per_node(table, config, cluster)
    assert need == pytest.approx(estimate(SMALL, cluster, gpus=2, global_batch=4, seq=128, zero=1,
                                          offload="optimizer", recompute="none").host_state_bytes_per_node)

    class Tables:
        def table_for(self, candidate):
            return table

    class Problem:
        candidate, bound_s = config, 1.0

    tight = _with_host_memory("a100-40g", 8 * HOST_RESERVED_BYTES_PER_GPU + need * 0.999)
    assert prune_host_memory([Problem()], Tables(), cluster)[1] == []
    kept, pruned = prune_host_memory([Problem()], Tables(), tight)
    assert kept == [] and pruned == [Solved(config, 1.0, pruned="host_memory")]


def test_llama3_70b_on_one_a100_is_no_longer_offered():
    """All states offloaded leave 21.9 GiB on the GPU, but ~1.1 TB on a host that has 1 TB."""
    from meshplan.planner.costing.offload import usable_host_memory_bytes

    cluster = load_cluster("a100-40g")
    job = dict(gpus=1, global_batch=8, seq=4096, zero=3, recompute="full", offload="params")
    prediction = estimate("llama3-70b", cluster, **job)
    assert prediction.peak_memory_bytes < cluster.device.usable_memory_bytes  # on the GPU alone it would fit
    assert prediction.host_state_bytes_per_node > 1.0e12 > usable_host_memory_bytes(cluster)
    assert not prediction.fits
    from meshplan.planner.search.driver import search_plan

    with pytest.raises(MeshplanError, match=r"no plan of 'llama3-70b' fits: 1 candidate\(s\) fit on the GPUs only by "
                       r"offloading more model states than their nodes' host memory holds \(the leanest 1182.7 GiB"):
        search_plan("llama3-70b", cluster, 1, 8, seq=4096, top_k=1, mbs=1, recompute="full", offload="params")


def test_estimate_says_the_host_is_full_and_what_would_fit(run_cli):
    code, out, err = run_cli("estimate", "--model", "llama3-70b", "--cluster", "a100-40g", "--gpus", "1",
                             "--gbs", "8", "--seq", "4096", "--zero", "3", "--recompute", "full",
                             "--offload", "params")
    assert code == 2
    assert "fits: NO (the offloaded states exceed the host memory)" in out
    assert "GiB of offloaded states on the busiest node, 675.32 GiB usable" in out
    line = err.strip().splitlines()[-1]
    assert line.startswith("meshplan estimate: does not fit in host memory: the offloaded parameters, gradients "
                           "and optimizer states of 1 GPU(s) take ")
    assert line.endswith("use more nodes (ZeRO shards the offloaded states over the data-parallel ranks of all of them), "
                         "or --offload optimizer (the parameters and gradients stay on the GPUs)")
    code, out, _ = run_cli("estimate", "--model", "llama3-70b", "--cluster", "a100-40g", "--gpus", "1",
                           "--gbs", "8", "--seq", "4096", "--zero", "3", "--recompute", "full",
                           "--offload", "params", "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] is False and data["host_state_bytes_per_node"] > 1e12
