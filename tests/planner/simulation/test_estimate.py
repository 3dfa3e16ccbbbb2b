"""`estimate`: the closed form against the simulator, the bubble and in-flight memory of whole
predictions, and the CLI's refusals (exit 2) and JSON keys."""
import json
from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.simulation.estimator import (closed_form_prediction, default_precision, make_config, microbatches_in_flight,
                              predict)
from meshplan.planner.contracts.graph import ModelGraph
from meshplan.planner.costing.hardware import load_cluster
from tests.planner.costing.test_cost import gpt_layers

A100 = load_cluster("a100-80g")
TINY = "gpt:layers=2,hidden=96,heads=12,vocab=512"


def blocks_only(num_blocks, hidden=2048, heads=16, seq=1024):
    graph = gpt_layers(num_blocks, hidden, heads, 51200, seq)
    return ModelGraph("blocks", graph.seq, graph.dtype, graph.attention, graph.layers[1:-1], graph.info)


def ideal_cluster():
    """Free communication and a negligible optimizer: the step is the pipeline alone."""
    fast = replace(A100.intra_node, bw_bytes_per_s=1e20, latency_s=0.0)
    return replace(A100, intra_node=fast, inter_node=fast, optimizer_bytes_per_param=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 16), (8, 8)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_bubble_of_a_balanced_pipeline(p, m, schedule):
    graph, cluster = blocks_only(16), ideal_cluster()
    config = ParallelConfig(gpus=p, global_batch=m, pp=p, schedule=schedule)
    expected = (p - 1) / (m + p - 1)
    # Closed form: exact up to the 1e-12 optimizer left in; the simulator plays the schedule
    # event by event and must land on the same fraction (1e-3: float accumulation only).
    assert closed_form_prediction(graph, cluster, config).bubble_fraction == pytest.approx(expected, rel=1e-6)
    assert predict(graph, cluster, config).bubble_fraction == pytest.approx(expected, rel=1e-3)


CASES = [dict(gpus=8, global_batch=64, tp=8), dict(gpus=16, global_batch=64, tp=4, pp=4),
         dict(gpus=64, global_batch=256, tp=8, pp=2, mbs=2, zero=1),
         dict(gpus=16, global_batch=64, tp=4, pp=4, schedule="interleaved", vpp=2),
         dict(gpus=16, global_batch=64, tp=4, pp=4, schedule="gpipe"),
         dict(gpus=32, global_batch=64, tp=2, pp=4, zero=2, recompute="selective", sp=True)]


@pytest.mark.parametrize("case", CASES)
def test_closed_form_agrees_with_the_simulator(case):
    graph = gpt_layers(16, 4096, 32, 51200, 2048)
    config = make_config(graph, A100, **case)
    closed, simulated = closed_form_prediction(graph, A100, config), predict(graph, A100, config)
    # 2%: the closed form charges asynchronous p2p and DP reduction by overlap rules (fill/drain
    # path, last backward window); the simulator plays them on their own streams.
    assert closed.step_time_s == pytest.approx(simulated.step_time_s, rel=0.02)
    # memory differs only in transient buffers (2%)
    assert closed.peak_memory_bytes == pytest.approx(simulated.peak_memory_bytes, rel=0.02)
    assert closed.model_tflops_per_gpu * closed.step_time_s == pytest.approx(
        simulated.model_tflops_per_gpu * simulated.step_time_s, rel=1e-9)


def test_in_flight_microbatches_per_schedule():
    graph = blocks_only(8)
    config = ParallelConfig(gpus=4, global_batch=16, pp=4)
    assert [microbatches_in_flight(config, r) for r in range(4)] == [4, 3, 2, 1]
    assert microbatches_in_flight(replace(config, schedule="gpipe"), 0) == 16
    interleaved = ParallelConfig(gpus=4, global_batch=16, pp=4, schedule="interleaved", virtual_stages=2)
    assert microbatches_in_flight(interleaved, 0) == (2 * 3 + 4 + 1) / 2  # Megatron's warm-up
    # fp32: every saved tensor takes twice its bf16 bytes. (bf16-mixed without FSDP runs under
    # autocast, whose fp32 norm inputs and per-Linear bf16 copies Korthikanti's counts lack.)
    memory = closed_form_prediction(graph, A100, replace(config, precision="fp32")).memory
    per_stage = 2 * (24 + 8) * 1024 * 2048  # two blocks of (24 + 8) s h bytes + flash-free scores
    per_stage += 2 * 2 * 16 * 1024 * 1024  # 2 a s^2 per block
    boundary = 2 * 1024 * 2048  # the stage's output, kept for its backward (not on the last stage)
    per_stage, boundary = 2 * per_stage, 2 * boundary
    assert memory[0].activations == pytest.approx(4 * (per_stage + boundary))
    # the last stage's input, which its first block saves, is counted there, as an activation
    assert memory[3].activations == pytest.approx(per_stage)
    # one receive buffer in transit per boundary and direction (`costing.pipeline.
    # receive_buffer_bytes`): rank 1 receives inputs and gradients, rank 0 only gradients
    assert memory[1].buffers - memory[0].buffers == pytest.approx(boundary)


def test_precision_defaults():
    assert default_precision(load_cluster("h100-sxm")) == "bf16-mixed"
    assert default_precision(load_cluster("cpu")) == "fp32"


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "10", "--tp", "4"], "not divisible by tp"),
    (["--gpus", "32", "--tp", "16"], "inside a node"),
    (["--gpus", "8", "--tp", "2", "--pp", "4", "--gbs", "2"], "fewer than the 4 pipeline stages"),
    (["--gpus", "8", "--gbs", "12", "--mbs", "1"], "not divisible by dp=8"),
    (["--gpus", "8", "--tp", "8", "--gbs", "8", "--mbs", "3"], "does not divide"),
    (["--gpus", "2", "--pp", "2", "--schedule", "interleaved", "--vpp", "2", "--gbs", "3"], "micro-batch"),
])
def test_impossible_configurations_exit_2_without_profiling(run_cli, argv, message):
    base = {"--model": TINY, "--cluster": "a100-80g", "--gbs": "64", "--seq": "64"}
    args = [x for k, v in base.items() if k not in argv for x in (k, v)] + argv
    code, out, err = run_cli("estimate", *args)
    assert code == 2, err
    assert message in err and out == ""
    assert len(err.strip().splitlines()) == 1


def test_unknown_cluster_exits_2(run_cli):
    code, _, err = run_cli("estimate", "--model", TINY, "--cluster", "tpu-v9", "--gpus", "8", "--gbs", "8")
    assert code == 2 and "a100-80g" in err


@pytest.mark.timeout(120)
def test_heads_not_divisible_by_tp_exits_2(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path))
    code, _, err = run_cli("estimate", "--model", TINY, "--cluster", "a100-80g", "--gpus", "8", "--gbs", "8",
                           "--seq", "64", "--tp", "8")
    assert code == 2 and "12 heads" in err


@pytest.mark.timeout(120)
def test_json_has_the_design_keys(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path))
    code, out, err = run_cli("estimate", "--model", TINY, "--cluster", "a100-80g", "--gpus", "8", "--gbs", "16",
                             "--seq", "64", "--tp", "2", "--pp", "2", "--zero", "1", "--json")
    assert code == 0, err
    data = json.loads(out)
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hw_tflops_per_gpu", "mfu",
                "peak_memory_bytes", "memory_bytes", "bubble_fraction", "fits"):
        assert key in data
    assert len(data["memory_bytes"]) == 2
    assert set(data["memory_bytes"][0]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    assert data["tokens_per_s"] == pytest.approx(16 * 64 / data["step_time_s"])
    assert data["peak_memory_bytes"] == max(m["total"] for m in data["memory_bytes"])
    code, out, _ = run_cli("estimate", "--model", TINY, "--cluster", "a100-80g", "--gpus", "8", "--gbs", "16",
                           "--seq", "64", "--tp", "2", "--pp", "2")
    assert code == 0 and "step time" in out and "MFU" in out and "fits" in out


def test_executable_fast_exit_keeps_output_and_exit_codes(tmp_path):
    """The executable leaves the analysis commands with os._exit: whatever it printed through a
    pipe must be complete (valid JSON), and the exit codes must stay 0 and 2."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MESHPLAN_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "meshplan.cli", "estimate", "--model", TINY, "--cluster", "a100-80g",
            "--gbs", "8", "--seq", "64", "--tp", "1", "--pp", "1"]
    good = subprocess.run([*base, "--gpus", "2", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["tokens_per_s"] > 0
    bad = subprocess.run([*base, "--gpus", "3"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr


def test_a_configuration_that_does_not_fit_names_the_first_zero_stage_that_does(run_cli):
    """The hint's figures are the estimate of the same job at that stage; stages below it do not fit."""
    from meshplan.planner.simulation.estimator import estimate

    job = dict(spec="llama3-70b", cluster="h100-sxm", gpus=64, global_batch=64, seq=4096, tp=8, recompute="full")
    assert not estimate(**job, zero=0).fits
    fitting = estimate(**job, zero=1)
    assert fitting.fits
    code, out, err = run_cli("estimate", "--model", "llama3-70b", "--cluster", "h100-sxm", "--gpus", "64",
                             "--gbs", "64", "--seq", "4096", "--tp", "8", "--recompute", "full", "--zero", "0")
    assert code == 0, err
    hint = out.strip().splitlines()[-1]
    assert hint == (f"hint: with --zero 1 (sharding the optimizer states) it fits: "
                    f"{fitting.peak_memory_bytes / 2**30:.2f} GiB per GPU, step {fitting.step_time_s * 1e3:.1f} ms")


def test_metas_llama3_405b_layout_fits_with_the_activations_derived_by_hand():
    """Meta's published Llama 3 405B layout (TP 8, SP, PP 16 interleaved x4, seq 8192, micro-batch
    1, 16 micro-batches per replica, ZeRO-1) on 80 GB H100s. With as many micro-batches as stages
    the interleaved warm-up runs every chunk's forward before the first backward, so rank 1
    (8 blocks in 4 chunks) holds 16 x 8 block activations, each (sharded + replicated) / t with
    SP, and its 16 x 4 received chunk inputs, s x h / t each: exactly, byte for byte. Its states,
    as FSDP2 under ZeRO-1 holds them over 128 data ranks: the stage's bf16 parameters gathered
    whole plus their fp32 shard, the whole fp32 gradient, and the two fp32 Adam moments' shard."""
    from meshplan.planner.profiling.profiler import profile
    from meshplan.planner.simulation.estimator import estimate

    h100 = load_cluster("h100-sxm")
    got = estimate("llama3-405b", h100, 16384, 2048, 8192, tp=8, pp=16, mbs=1, zero=1, sp=True,
                   schedule="interleaved", vpp=4)
    block = profile("llama3-405b", 8192).layer("blocks.0")
    tp, microbatches, blocks, chunks = 8, 16, 8, 4
    activations = (microbatches * blocks * (block.act_tp_sharded_bytes + block.act_tp_replicated_bytes) / tp
                   + microbatches * chunks * block.input_bytes / tp)
    rank1 = got.memory[1]
    assert rank1.activations == activations
    stage_params = blocks * block.num_params / tp
    dp = 16384 // (tp * 16)
    assert rank1.params == pytest.approx((2 + 4 / dp) * stage_params)
    assert rank1.grads == pytest.approx(4 * stage_params)
    assert rank1.optimizer == pytest.approx(8 * stage_params / dp)
    assert got.fits and got.peak_memory_bytes <= h100.device.usable_memory_bytes
