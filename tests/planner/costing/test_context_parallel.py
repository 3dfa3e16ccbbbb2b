"""Context parallelism in the cost model, the estimate, the plan file and the search.

Rules (planner.costing.context_parallel): per-token work at mbs/cp, data parallelism over dp*cp,
K/V all-gather forward and reduce-scatter backward over cp ranks tp apart, the gathered K/V kept
for attention's backward. Each is checked against its formula; the causal work shares against
a brute-force count of the query-key pairs each rank computes.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.plan import plan_from_json
from meshplan.planner.costing import context_parallel as cpm
from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.compute_time import kernel_efficiency
from meshplan.planner.costing.device_time import attention_time_s, flash_attention_flops, memory_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from tests.planner.costing.meshes import mesh

H100 = load_cluster("h100-sxm")
SPEC = "llama:layers=2,hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000"


@pytest.fixture(scope="module")
def graph():
    from meshplan.planner.profiling.profiler import profile

    return profile(SPEC, 4096, dtype="bf16")


def _causal_pairs(positions: list[int]) -> int:
    return sum(p + 1 for p in positions)  # query p attends to keys 0..p


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_attention_work_shares_count_causal_pairs(cp):
    seq = 32 * cp
    chunk = seq // (2 * cp)
    total = _causal_pairs(list(range(seq)))
    balanced = [_causal_pairs([*range(i * chunk, (i + 1) * chunk),
                               *range((2 * cp - 1 - i) * chunk, (2 * cp - i) * chunk)]) for i in range(cp)]
    assert len(set(balanced)) == 1  # every rank the same work
    assert balanced[0] / total == pytest.approx(cpm.attention_work_share(cp), rel=1e-12)
    contiguous_last = _causal_pairs(list(range(seq - seq // cp, seq)))
    # chunk-level share (2cp-1)/cp^2; the diagonal blocks' half-pairs make it exact only as seq grows
    assert contiguous_last / total == pytest.approx(cpm.attention_work_share(cp, balanced=False), rel=2 / seq * cp)


def test_cp_layer_cost_is_the_local_share_plus_the_kv_exchange(graph):
    block = graph.layer("blocks.0")
    tp, cp, dp, mbs = 2, 4, 8, 8  # mbs / cp whole: the local share is a config of its own
    with_cp = layer_cost(block, mesh(tp=tp, dp=dp, cp=cp, zero=1, microbatch_size=mbs), H100, graph.info,
                         profile_dtype="bf16")
    local = layer_cost(block, mesh(tp=tp, dp=dp * cp, zero=1, microbatch_size=mbs // cp), H100, graph.info,
                       profile_dtype="bf16")
    # whole sequence's K and V on one TP rank: 2 x mbs x s x (kv_heads / tp) x head_dim x 2 bytes
    gathered = 2 * mbs * 4096 * (4 / tp) * 64 * 2
    assert cpm.kv_gather_bytes(block, mesh(tp=tp, cp=cp, microbatch_size=mbs), graph.info, "bf16", "bf16") == gathered
    assert with_cp.cp_fwd_comm_s == pytest.approx(collective_time_s("all_gather", gathered, cp, H100, tp))
    assert with_cp.cp_bwd_comm_s == pytest.approx(collective_time_s("reduce_scatter", gathered, cp, H100, tp))
    assert with_cp.activation_bytes == pytest.approx(local.activation_bytes + gathered * (1 - 1 / cp))
    # the attention kernel runs on the rank's s/cp queries: its speed there (`kernel_efficiency`)
    attention = flash_attention_flops(block, "flash", H100) * (mbs // cp) / tp
    at = [attention_time_s(attention, H100, "bf16", kernel_efficiency(block, graph.info, H100, "flash", "bf16", c))
          for c in (cp, 1)]
    # and meshplan's executor copies around its gathers (`gather_copy_bytes`): its local K and V made
    # contiguous and the gathered ones re-concatenated forward, the reduce-scatter's input regrouped backward
    copies_fwd, copies_bwd = memory_time_s(2 * (gathered / cp + gathered), H100), memory_time_s(2 * gathered, H100)
    assert cpm.gather_copy_bytes(gathered, mesh(tp=tp, cp=cp, microbatch_size=mbs), graph.info) == \
        (2 * (gathered / cp + gathered), 2 * gathered, 0.0)
    assert with_cp.fwd_compute_s - local.fwd_compute_s == pytest.approx(at[0] - at[1] + copies_fwd)
    assert with_cp.bwd_compute_s - local.bwd_compute_s == pytest.approx(2 * (at[0] - at[1]) + copies_bwd)
    assert at[0] > at[1]  # 1024 queries per call run slower than 4096
    for field in ("tp_fwd_comm_s", "dp_grad_comm_s", "param_bytes", "grad_bytes", "optimizer_bytes", "output_bytes"):
        assert getattr(with_cp, field) == getattr(local, field), field
    # per-token work really is 1/cp: the local config's activations are a quarter of mbs's
    whole = layer_cost(block, mesh(tp=tp, dp=dp * cp, zero=1, microbatch_size=mbs), H100, graph.info,
                       profile_dtype="bf16")
    assert local.activation_bytes == pytest.approx(whole.activation_bytes / cp)
    assert with_cp.output_bytes == pytest.approx(whole.output_bytes / cp)


def test_cp_shows_in_estimate_and_breakdown_adds_up():
    from meshplan import estimate

    pred = estimate("llama3-70b", "h100-sxm", 64, 128, 8192, tp=4, pp=4, cp=2, vpp=5, schedule="interleaved",
                    sp=True, zero=1)
    assert pred.breakdown["cp_comm"] > 0
    assert sum(pred.breakdown.values()) == pytest.approx(pred.step_time_s, rel=1e-9)
    without = estimate("llama3-70b", "h100-sxm", 64, 128, 8192, tp=4, pp=4, vpp=5, schedule="interleaved",
                       sp=True, zero=1)
    assert pred.breakdown.get("cp_comm", 0) > without.breakdown.get("cp_comm", 0) == 0
    # half the tokens per rank: activations per rank drop although K/V are kept whole
    assert pred.peak_memory_bytes < without.peak_memory_bytes


def test_cp_configuration_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"pp\*dp\*cp\*tp = 1\*4\*2\*1 = 8 must equal the number of GPUs \(4\)"):
        ParallelConfig(gpus=4, global_batch=8, dp=4, cp=2)
    run = subprocess.run([sys.executable, "-m", "meshplan.cli", "estimate", "--model", SPEC, "--cluster", "h100-sxm",
                          "--gpus", "8", "--gbs", "8", "--seq", "1000", "--cp", "8"], capture_output=True, text=True)
    assert run.returncode == 2 and "not divisible by 16" in run.stderr and "Traceback" not in run.stderr


def test_plan_json_carries_cp_and_version_1_plans_load(tmp_path):
    from meshplan.executor.plans import uniform_plan

    plan = uniform_plan("gpt:layers=2,hidden=32,heads=2,vocab=64", 16, 8, load_cluster("cpu"), dp=2, cp=2,
                        microbatch_size=2)
    data = plan.to_json()
    assert data["mesh"] == {"pp": 1, "dp": 2, "tp": 1, "cp": 2} and data["schema_version"] == 2
    assert plan_from_json(json.loads(json.dumps(data))).config.cp == 2
    old = uniform_plan("gpt:layers=2,hidden=32,heads=2,vocab=64", 16, 8, load_cluster("cpu"), dp=2,
                       microbatch_size=2).to_json()
    old["schema_version"] = 1
    assert "cp" not in old["mesh"] and plan_from_json(old).config.cp == 1


def test_the_search_uses_cp_for_long_sequences():
    """llama3-8b at 128K tokens per sequence on 64 H100s: without CP a sequence fits only with TP 8,
    two pipeline stages and recomputation (41.9 s per step); CP keeps each rank's share of the
    sequence small enough to need none of that (33.7 s). (The cp=1 search, pinned, takes a minute
    here; its figure is quoted, not re-run.)"""
    from meshplan.planner.search.driver import search_plan

    plan = search_plan("llama3-8b", "h100-sxm", 64, 64, 131072, top_k=2)
    assert plan.config.cp > 1
    assert all(layer.recompute == "none" for layer in plan.layers)
    assert plan.prediction["fits"]
    assert plan.solver["ilp_objective_s"] == pytest.approx(plan.prediction["step_time_s"], rel=0.02)


@pytest.mark.parametrize("batch, heads, view", [(1, 1, True), (1, 2, False), (2, 1, False)])
def test_the_executors_kv_gather_copies_as_torch_re_concatenates(graph, batch, heads, view):
    """torch re-concatenates K/V gathered on the sequence, dim 2 of (b, heads, s, d), by copy unless
    one sequence and one head put nothing before it; `gather_copy_bytes` follows it, and a full
    recomputation's forward copies again."""
    import torch
    from torch._utils import _maybe_view_chunk_cat

    gathered_shards = torch.randn(4 * batch, heads, 8, 16)
    out = _maybe_view_chunk_cat(gathered_shards, 4, 2)
    assert torch.equal(out, torch.cat(torch.chunk(gathered_shards, 4, dim=0), dim=2))
    assert (out.untyped_storage().data_ptr() == gathered_shards.untyped_storage().data_ptr()) is view
    tp = 4 // heads  # the spec's 4 K/V heads over tp ranks: `heads` a rank
    config = mesh(tp=tp, cp=4, microbatch_size=batch, recompute="full")
    fwd, bwd, rerun = cpm.gather_copy_bytes(1000.0, config, graph.info)
    assert fwd == 2 * (1000.0 / 4 + 1000.0 * (not view)) and bwd == 2 * 1000.0 and rerun == fwd
