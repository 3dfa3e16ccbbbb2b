"""Executor pieces that need no second process: schedule, data, checkpoints, refusals, stages."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.executor.data import DataSource, global_batch, make_source, replica_slice
from meshplan.executor.launch import LaunchResult, describe_failure
from meshplan.executor.measure import tokens_per_s
from meshplan.planner.contracts.measurement import Measurement, load_measurement, save_measurement
from meshplan.planner.costing.state_memory import dp_method
from meshplan.executor.plans import uniform_plan
from meshplan.executor.runtime import Hyperparameters, lr_at
from meshplan.executor.checks import check_plan_runnable
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.contracts.plan import ModelRef, save_plan

SPEC = "gpt:layers=4,hidden=64,heads=4,vocab=256"


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("cpu")


def test_learning_rate_warms_up_linearly_then_follows_the_cosine():
    hp = Hyperparameters(lr=1e-3, min_lr_ratio=0.1, warmup_fraction=0.2)
    total = 10  # warm-up = round(0.2 * 10) = 2 steps
    assert lr_at(0, total, hp) == pytest.approx(0.5e-3)
    assert lr_at(1, total, hp) == pytest.approx(1e-3)
    for step in range(2, total):
        progress = (step - 2) / 8
        expected = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * progress))
        assert lr_at(step, total, hp) == pytest.approx(expected, rel=1e-12)
    assert lr_at(total - 1, total, hp) > 1e-4  # never below the floor


def test_synthetic_batches_depend_only_on_seed_and_step():
    source = DataSource(vocab=256, seq=8, seed=1)
    inputs, targets = global_batch(source, 3, 4)
    again, _ = global_batch(source, 3, 4)
    other, _ = global_batch(source, 4, 4)
    assert inputs.shape == targets.shape == (4, 8)
    assert inputs.equal(again) and not inputs.equal(other)
    assert inputs[:, 1:].equal(targets[:, :-1])  # targets are the next tokens
    assert int(inputs.max()) < 256
    first, _ = replica_slice(inputs, targets, 1, 2)
    assert first.equal(inputs[2:4])


def test_text_data_is_byte_tokens_in_consecutive_windows(tmp_path):
    text = bytes(range(200)) * 3
    (tmp_path / "t.txt").write_bytes(text)
    source = make_source(str(tmp_path / "t.txt"), vocab=256, seq=10, seed=0)
    inputs, targets = global_batch(source, 1, 3)
    span = len(text) - 11
    for row in range(3):
        start = ((1 * 3 + row) * 10) % span
        assert inputs[row].tolist() == list(text[start:start + 10])
        assert targets[row].tolist() == list(text[start + 1:start + 11])


def test_data_arguments_are_checked(tmp_path):
    with pytest.raises(MeshplanError, match="neither 'synthetic' nor a readable"):
        make_source(str(tmp_path / "missing.txt"), 256, 8, 0)
    (tmp_path / "t.txt").write_text("hello world, some text")
    with pytest.raises(MeshplanError, match="vocabulary of at least 256"):
        make_source(str(tmp_path / "t.txt"), 100, 8, 0)
    with pytest.raises(MeshplanError, match="too short"):
        make_source(str(tmp_path / "t.txt"), 256, 64, 0)


def test_plans_the_executor_cannot_run_are_refused_before_launch(cluster):
    plan = uniform_plan(SPEC, 16, 8, cluster, dp=2, microbatch_size=2)
    with pytest.raises(MeshplanError, match="needs 2 processes.*--nproc 2"):
        check_plan_runnable(plan, 4)
    with pytest.raises(MeshplanError, match="not executable"):
        check_plan_runnable(replace(plan, executable=False, not_executable_reason="layerwise"), 2)
    with pytest.raises(MeshplanError, match="does not place layer"):
        check_plan_runnable(replace(plan, model=ModelRef(spec=SPEC.replace("layers=4", "layers=6"), seq=16)), 2)
    for zero in (2, 3):  # a split backward runs them as ZeRO-1: refused, not silently downgraded
        check_plan_runnable(uniform_plan(SPEC, 16, 8, cluster, pp=2, dp=2, microbatch_size=2, zero=zero), 4)
        piped = uniform_plan(SPEC, 16, 8, cluster, pp=2, dp=2, microbatch_size=1, zero=zero, schedule="zbv",
                             virtual_stages=2)
        with pytest.raises(MeshplanError, match=f"ZeRO-{zero} with the zbv schedule .* runs as ZeRO-1"):
            check_plan_runnable(piped, 4)
    odd_heads = uniform_plan("gpt:layers=2,hidden=48,heads=3,vocab=256", 16, 4, cluster, tp=2)
    with pytest.raises(MeshplanError, match="tp=2 does not divide layer 'blocks.0': 3 heads, 3 KV heads, MLP width 192"):
        check_plan_runnable(odd_heads, 2)
    odd_seq = uniform_plan(SPEC, 15, 4, cluster, tp=2, sp=True)
    with pytest.raises(MeshplanError, match="sequence length divisible by 2"):
        check_plan_runnable(odd_seq, 2)
    check_plan_runnable(plan, 2)


def test_expert_parallel_plans_outside_the_executor_are_refused(cluster):
    moe = "moe:layers=2,hidden=32,heads=2,kv_heads=2,experts=4,top_k=2,expert_ffn=32,vocab=256"
    with pytest.raises(MeshplanError, match="without sequence parallelism"):
        check_plan_runnable(uniform_plan(moe, 16, 4, cluster, tp=2, dp=2, ep=2, sp=True), 4)
    with pytest.raises(MeshplanError, match=r"expert parallelism \(ep=2\) needs a mixture-of-experts model"):
        check_plan_runnable(uniform_plan(SPEC, 16, 4, cluster, dp=2, ep=2), 2)
    with pytest.raises(MeshplanError, match="ep=3 must divide the 4 routed experts"):
        check_plan_runnable(uniform_plan(moe, 16, 6, cluster, dp=3, ep=3), 3)
    # the folded layout: experts under tensor parallelism (etp = tp or 1) and EP with HSDP run
    for runnable in (dict(dp=2, ep=2), dict(dp=2, ep=2, zero=3), dict(cp=2, ep=2), dict(pp=2, dp=2, ep=2, zero=1),
                     dict(tp=2, dp=2, ep=2), dict(tp=2, dp=2, ep=4, etp=1), dict(dp=4, ep=2, zero=3, shard_group=2)):
        plan = uniform_plan(moe, 16, 8, cluster, microbatch_size=2 if "pp" in runnable else 1, **runnable)
        check_plan_runnable(plan, plan.config.gpus)


def test_cli_refuses_bad_requests_with_exit_code_2(tmp_path, cluster, run_cli):
    save_plan(uniform_plan(SPEC, 16, 8, cluster, dp=2, microbatch_size=2), tmp_path / "plan.json")
    code, _, err = run_cli("train", "--plan", tmp_path / "plan.json", "--nproc", 3)
    assert code == 2 and "needs 2 processes" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("train", "--plan", tmp_path / "plan.json", "--resume")
    assert code == 2 and "--checkpoint-dir" in err
    code, _, err = run_cli("train", "--plan", tmp_path / "missing.json")
    assert code == 2 and "not found" in err


def test_data_parallel_wrapper_per_zero_stage_and_mesh():
    assert dp_method(zero=0, dp=1, tp=2, pp=2) == "none"
    assert dp_method(zero=0, dp=2, tp=1, pp=1) == "ddp"
    assert dp_method(zero=0, dp=2, tp=2, pp=1) == "replicate"  # DDP fails on DTensor TP
    assert dp_method(zero=0, dp=2, tp=1, pp=2) == "replicate"  # DDP under PP only with 1F1B
    assert {dp_method(zero=z, dp=2, tp=1, pp=1) for z in (1, 2, 3)} == {"fsdp"}
    # bf16-mixed: FSDP2's mixed-precision policy on every layout (bf16 weights cast once, not per
    # micro-batch as autocast would), so never unwrapped and never DDP
    bf16 = "bf16-mixed"
    assert dp_method(zero=0, dp=1, tp=2, pp=2, precision=bf16) == "replicate"
    assert dp_method(zero=0, dp=2, tp=1, pp=1, precision=bf16) == "replicate"
    assert dp_method(zero=1, dp=1, tp=1, pp=1, precision=bf16) == "replicate"
    assert {dp_method(zero=z, dp=2, tp=1, pp=1, precision=bf16) for z in (1, 2, 3)} == {"fsdp"}


def test_uniform_plan_interleaves_chunks_over_pipeline_ranks(cluster):
    plan = uniform_plan(SPEC, 16, 8, cluster, pp=2, microbatch_size=2, schedule="interleaved", virtual_stages=2)
    # 6 layers in 4 chunks: 2, 2, 1, 1; chunk j on rank j % 2, virtual stage j // 2
    assert [(layer.stage, layer.virtual_stage) for layer in plan.layers] == [
        (0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (1, 1)]
    assert plan.chunks() == [[0, 1], [2, 3], [4], [5]]


def test_failure_description_names_the_first_failed_rank(tmp_path):
    output = ("...\nRoot Cause (first observed failure):\n[0]:\n  time      : 2026\n  host      : h\n"
              "  rank      : 3 (local_rank: 3)\n  exitcode  : -9 (pid: 123)\n")
    (tmp_path / "error_rank0.txt").write_text("RuntimeError: peer closed\n")
    message = describe_failure(LaunchResult(exit_code=1, output_tail=output), tmp_path, None)
    assert message.startswith("rank 3 failed (killed by SIGKILL)")
    (tmp_path / "error_rank3.txt").write_text("ValueError: bad shard\n")
    message = describe_failure(LaunchResult(exit_code=1, output_tail=output), tmp_path, None)
    assert message == "rank 3 failed (killed by SIGKILL); ValueError: bad shard"
    agent_gone = describe_failure(LaunchResult(exit_code=-9, output_tail="step 3/9 loss 5.5\n"), tmp_path / "x", None)
    assert agent_gone == "the torchrun agent was killed by SIGKILL"


def test_failure_description_names_the_killed_rank_not_the_peer_it_broke(tmp_path):
    """torchrun can observe a SIGKILLed rank and the rank whose collective it broke in one poll and
    call either the root cause: the rank that recorded only a lost peer is not the one named."""
    def failure(index, rank, code):
        return f"[{index}]:\n  time      : 2026\n  host      : h\n  rank      : {rank} (local_rank: {rank})\n" \
               f"  exitcode  : {code} (pid: 12{rank})\n  error_file: <N/A>\n"
    output = ("train.py FAILED\nFailures:\n" + failure(1, 1, -9) + "-----\nRoot Cause (first observed failure):\n"
              + failure(0, 0, -6))
    (tmp_path / "error_rank0.txt").write_text("RuntimeError: [pair.cc:537] Read error: Connection reset by peer\n")
    message = describe_failure(LaunchResult(exit_code=1, output_tail=output), tmp_path, None)
    assert message.startswith("rank 1 failed (killed by SIGKILL); rank0 reported: RuntimeError")  # the consequence
    (tmp_path / "error_rank1.txt").write_text("RuntimeError: Connection closed by peer\n")  # both lost a peer
    message = describe_failure(LaunchResult(exit_code=1, output_tail=output), tmp_path, None)
    assert message.startswith("rank 0 failed (killed by SIGABRT); RuntimeError: [pair.cc:537]")


def test_measurement_round_trips_and_validates(tmp_path):
    times = [2.0, 1.0, 0.5, 0.5]
    measurement = Measurement(world_size=2, plan_digest="abc", step_times_s=tuple(times), warmup_steps=2,
                              peak_memory_bytes_per_rank=(10, 20), losses=(4.0, 3.0, 2.0, 1.0),
                              tokens_per_s=tokens_per_s(times, 2, 100), tokens_per_step=100, memory_source="x",
                              precision="fp32", backend="gloo", device="cpu")
    assert measurement.tokens_per_s == pytest.approx(200.0)  # 2 timed steps x 100 tokens / 1.0 s
    assert measurement.mean_step_time_s == pytest.approx(0.5)
    save_measurement(measurement, tmp_path / "m.json")
    assert load_measurement(tmp_path / "m.json") == measurement
    assert json.loads((tmp_path / "m.json").read_text())["mean_step_time_s"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="3 losses but 4 step times"):
        replace(measurement, losses=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="1 peak memory value\(s\) for world_size 2"):
        replace(measurement, peak_memory_bytes_per_rank=(1,))


def test_stages_chain_to_the_full_model_and_recompute_keeps_gradients():
    """Pipeline chunks keep full-model names and compose to the same function; checkpointed
    layers (full and selective) give bitwise the same loss and gradients as plain ones."""
    import torch

    from meshplan.executor.parallel.recompute import apply_recompute
    from meshplan.executor.parallel.stages import materialize, split_stages
    from meshplan.planner.models.registry import build_model
    from meshplan.planner.models.transformer import init_weights, lm_loss

    reference = build_model(SPEC, 16, device="cpu").module
    init_weights(reference, 7)
    names = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for mode in ("none", "full", "selective"):
        meta = build_model(SPEC, 16, device="meta").module
        stages = split_stages(meta, names, [[0, 1, 2], [3, 4, 5]], [0, 1])
        template = build_model(SPEC, 16, device="meta").module
        materialize(stages, template, 7, torch.device("cpu"), tied_embeddings=True)
        assert {n for s in stages for n, _ in s.named_parameters()} == \
            {n for n, _ in reference.named_parameters()} | {"head.proj.weight"}
        for stage in stages:
            for name in stage.layer_names:
                apply_recompute(stage.layer(name), mode)
        loss = lm_loss(stages[1](stages[0](tokens)), tokens)
        loss.backward()
        losses.append(loss.item())
        grads.append(stages[0].blocks["1"].mlp.up.weight.grad.clone())
    expected = lm_loss(reference(tokens), tokens)
    assert losses[0] == pytest.approx(expected.item(), rel=1e-6)  # same weights, same function
    assert losses[1] == losses[0] == losses[2]
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
