"""`estimate`: the simulator on the uniform plan. The balanced pipeline's step, bubble and
in-flight memory against the published formulas worked by hand, the configuration `estimate`
builds from its keywords, and the CLI's refusals (exit 2) and JSON keys."""
import json
from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import ModelGraph
from meshplan.planner.costing.fixed_costs import grad_norm_all_reduce_s, pipeline_action_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.simulation.estimator import default_precision, estimate, make_config, predict
from meshplan.planner.simulation.simulator import simulate_config
from tests.planner.costing.meshes import mesh
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


@pytest.mark.parametrize("schedule,p,m,v", [
    *((schedule, p, m, 1) for schedule in ("1f1b", "gpipe") for p, m in ((2, 4), (4, 4), (4, 16), (8, 8))),
    ("interleaved", 4, 8, 2), ("interleaved", 2, 8, 4), ("interleaved", 4, 4, 4)])
def test_step_and_bubble_of_a_balanced_pipeline(schedule, p, m, v):
    """16 equal blocks, free transfers: GPipe and 1F1B take (m + p - 1) T, interleaved 1F1B with
    v chunks per rank (m + (p - 1)/v) T (Narayanan et al. 2021), T a rank's busy time per
    micro-batch worked out here from one block's cost; then the optimizer tail."""
    graph, cluster = blocks_only(16), ideal_cluster()
    config = ParallelConfig(gpus=p, global_batch=m, pp=p, schedule=schedule, virtual_stages=v)
    block = layer_cost(graph.layers[0], mesh(pp=p), cluster, graph.info)
    blocks_per_rank = 16 // p
    # torch pipelining's fixed work per forward and per backward action, once per chunk
    busy_s = blocks_per_rank * (block.fwd_compute_s + block.bwd_compute_s) + 2 * v * pipeline_action_s(p, cluster)
    tail_s = blocks_per_rank * block.optimizer_step_s + grad_norm_all_reduce_s(p, cluster)
    fill = (p - 1) / v
    got = predict(graph, cluster, config)
    # 1e-9: the transfers left (bytes over 1e20 B/s) add ~1e-13 s to a ~0.1 s step; the rest is float
    assert got.step_time_s == pytest.approx((m + fill) * busy_s + tail_s, rel=1e-9)
    assert got.bubble_fraction == pytest.approx(fill / (m + fill), rel=1e-9)


def test_in_flight_activations_per_schedule():
    """A rank's peak activations are its micro-batches in flight times a micro-batch's bytes:
    1F1B min(m, p - rank), GPipe m, interleaved 1F1B (Megatron's warm-up, one more than torch's
    `_get_1f1b_rank_ops` warm-up) 2 (p - rank - 1) + (v - 1) p + 1 chunk-micro-batches."""
    graph = blocks_only(8)
    config = ParallelConfig(gpus=4, global_batch=16, pp=4, precision="fp32")
    # fp32: every saved tensor takes twice its bf16 bytes.
    per_block = 2 * ((24 + 8) * 1024 * 2048 + 2 * 16 * 1024 * 1024)  # (24 + 8) s h + 2 a s^2 bf16 bytes
    boundary = 2 * 2 * 1024 * 2048  # a chunk's output, kept for its backward (not the last chunk's)
    per_stage = 2 * per_block
    memory = predict(graph, A100, config).memory
    # exact: the simulator allocates and frees these very byte counts
    for rank in range(3):
        assert memory[rank].activations == pytest.approx(min(16, 4 - rank) * (per_stage + boundary), rel=1e-12)
    # the last stage's input, which its first block saves, is counted there, as an activation
    assert memory[3].activations == pytest.approx(per_stage, rel=1e-12)
    # one receive buffer in transit per boundary and direction (`costing.boundary_buffers.
    # receive_buffer_bytes`): rank 1 receives inputs and gradients, rank 0 only gradients
    assert memory[1].buffers - memory[0].buffers == pytest.approx(boundary, rel=1e-12)
    gpipe = predict(graph, A100, replace(config, schedule="gpipe")).memory
    assert gpipe[0].activations == pytest.approx(16 * (per_stage + boundary), rel=1e-12)
    # interleaved, one block per chunk: every in-flight chunk-micro-batch keeps its boundary
    # output, the last rank's too (its peak comes when it starts its first chunk's second
    # round, holding five micro-batches of that chunk and none of the model's last)
    interleaved = predict(graph, A100, replace(config, schedule="interleaved", virtual_stages=2)).memory
    for rank in range(4):
        warm_up = 2 * (4 - rank - 1) + (2 - 1) * 4 + 1
        assert interleaved[rank].activations == pytest.approx(warm_up * (per_block + boundary), rel=1e-12)


# (estimate's keywords, the ParallelConfig they mean, worked out by hand)
CONFIGS = [
    (dict(gpus=8, global_batch=64, tp=8), ParallelConfig(gpus=8, global_batch=64, tp=8)),
    (dict(gpus=64, global_batch=256, tp=8, pp=2, mbs=2, zero=1),
     ParallelConfig(gpus=64, global_batch=256, tp=8, pp=2, dp=4, microbatch_size=2, zero=1)),
    (dict(gpus=16, global_batch=64, tp=4, pp=4, schedule="interleaved", vpp=2),
     ParallelConfig(gpus=16, global_batch=64, tp=4, pp=4, schedule="interleaved", virtual_stages=2)),
    # a V always holds two chunks per rank: --vpp 2 is implied
    (dict(gpus=16, global_batch=64, tp=4, pp=2, schedule="zbv"),
     ParallelConfig(gpus=16, global_batch=64, tp=4, pp=2, dp=2, schedule="zbv", virtual_stages=2)),
    # sharding over every data rank is plain ZeRO: the shard group drops
    (dict(gpus=32, global_batch=64, tp=2, pp=4, zero=2, recompute="selective", sp=True, shard_group=4),
     ParallelConfig(gpus=32, global_batch=64, tp=2, pp=4, dp=4, zero=2, recompute="selective", sp=True)),
    (dict(gpus=64, global_batch=64, tp=2, pp=2, zero=3, shard_group=4, precision="fp32"),
     ParallelConfig(gpus=64, global_batch=64, tp=2, pp=2, dp=16, zero=3, shard_group=4, precision="fp32")),
]


@pytest.mark.parametrize("degrees,expected", CONFIGS)
def test_make_config_builds_the_configuration_the_degrees_mean(degrees, expected):
    graph = gpt_layers(16, 4096, 32, 51200, 2048)
    config = make_config(graph, A100, **degrees)
    assert config == expected
    got, simulated = predict(graph, A100, config), simulate_config(graph, A100, expected)
    assert got.step_time_s == simulated.step_time_s and got.memory == simulated.memory
    # MFU counts 6 N-ish model FLOPs: each layer's forward and backward, every sample
    model_flops = sum(layer.fwd_flops + layer.bwd_flops for layer in graph.layers) * expected.global_batch
    assert got.model_tflops_per_gpu == pytest.approx(model_flops / got.step_time_s / expected.gpus / 1e12, rel=1e-12)


@pytest.mark.timeout(120)
def test_estimate_is_the_simulator_on_the_uniform_plan(tmp_path, monkeypatch):
    """The public keywords end to end: the configuration built once, the model profiled, the
    step simulated on the balanced cut with the default recomputation."""
    from meshplan.planner.profiling.profiler import profile

    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path))
    got = estimate(TINY, "a100-80g", gpus=8, global_batch=16, seq=64, tp=2, pp=2, zero=1, schedule="zbv",
                   shard_group=2, recompute="full")
    config = ParallelConfig(gpus=8, global_batch=16, tp=2, pp=2, dp=2, zero=1, recompute="full", schedule="zbv",
                            virtual_stages=2)
    expected = simulate_config(profile(TINY, 64), A100, config)
    assert got.step_time_s == expected.step_time_s and got.memory == expected.memory
    assert got.hw_tflops_per_gpu > got.model_tflops_per_gpu  # the blocks' forward runs twice


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
    job = dict(spec="llama3-70b", cluster="h100-sxm", gpus=64, global_batch=64, seq=4096, tp=8, recompute="full")
    assert not estimate(**job, zero=0).fits
    fitting = estimate(**job, zero=1)
    assert fitting.fits
    code, out, err = run_cli("estimate", "--model", "llama3-70b", "--cluster", "h100-sxm", "--gpus", "64",
                             "--gbs", "64", "--seq", "4096", "--tp", "8", "--recompute", "full", "--zero", "0")
    assert code == 2, err  # priced, and does not fit
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
