"""Ulysses context parallelism (`cp_method` "ulysses") in the cost model, the configuration, the
plan file, the search, the executability rule, the CLI and the engines' exports.

Rules (planner.costing.ulysses): per-token work at mbs/cp as under all-gather; four all-to-alls
of q, k, v and the output each way over cp ranks tp apart; K/V heads split when cp divides them,
replicated cp/g times when g divides cp; the replicas' excess and, without recomputation, the o
projection's input kept beyond the layer's own share. Each is checked against its formula with
the numbers written out. (The executor's losses and measured memory: the CP cases of
tests/executor/test_executor_parity.py and test_memory_prediction.py.)
"""
from __future__ import annotations

import json

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import plan_from_json
from meshplan.planner.costing import ulysses
from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.executable import model_facts, why_not_executable
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from tests.planner.costing.meshes import mesh

H100 = load_cluster("h100-sxm")
SEQ = 4096
SPEC = "llama:layers=2,hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000"  # head_dim 64
# 6 heads, 2 K/V heads: Ulysses splits over cp 2 (K/V 1 each), not over cp 4 (6 heads)
ODD_SPEC = "llama:layers=2,hidden=384,heads=6,kv_heads=2,ffn=1024,vocab=32000"


@pytest.fixture(scope="module")
def graph():
    from meshplan.planner.profiling.profiler import profile

    return profile(SPEC, SEQ, dtype="bf16")


@pytest.fixture(scope="module")
def odd_graph():
    from meshplan.planner.profiling.profiler import profile

    return profile(ODD_SPEC, 2 * SEQ, dtype="bf16")  # 2048 tokens per rank at cp 4: the search tries it


def test_kv_heads_split_or_replicated():
    assert ulysses.ulysses_kv_heads(8, 4) == 8  # split: 2 per rank
    assert ulysses.ulysses_kv_heads(2, 4) == 4  # replicated twice: 1 per rank
    assert ulysses.ulysses_kv_heads(1, 8) == 8  # multi-query: the one head on every rank
    with pytest.raises(ValueError, match="cp=4 to divide the 6 K/V heads"):
        ulysses.ulysses_kv_heads(6, 4)


def test_head_rule_names_the_numbers():
    assert ulysses.ulysses_head_problem(16, 4, 2, 4, "cp=4") is None
    assert ulysses.ulysses_head_problem(16, 4, 1, 1, "cp=1") is None
    problem = ulysses.ulysses_head_problem(16, 4, 2, 16, "--cp 16")
    assert "16 heads / tp 2 = 8 are not divisible by cp 16" in problem and "--cp-method all-gather" in problem
    problem = ulysses.ulysses_head_problem(24, 6, 1, 4, "cp=4")
    assert "the 6 K/V heads" in problem and "cp 4" in problem


@pytest.mark.parametrize("tp,cp,replicated_kv", [(2, 4, True), (1, 4, False)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_cost_is_the_local_share_plus_four_all_to_alls(graph, tp, cp, replicated_kv, recompute):
    block = graph.layer("blocks.0")
    dp, mbs = 2, 8
    config = mesh(tp=tp, dp=dp, cp=cp, zero=1, microbatch_size=mbs, recompute=recompute, cp_method="ulysses")
    with_cp = layer_cost(block, config, H100, graph.info, profile_dtype="bf16")
    local = layer_cost(block, mesh(tp=tp, dp=dp * cp, zero=1, microbatch_size=mbs // cp, recompute=recompute),
                       H100, graph.info, profile_dtype="bf16")
    tokens = mbs * SEQ / cp
    heads, kv_local = 16 // tp, 4 // tp  # per TP rank: (8, 2) or (16, 4)
    kv_sent = cp if replicated_kv else kv_local  # 2 K/V heads replicated to 4, or 4 split
    q_bytes, kv_bytes = tokens * heads * 64 * 2, tokens * kv_sent * 64 * 2
    assert ulysses.exchanged_bytes(block, config, graph.info, "bf16", "bf16") == (q_bytes, kv_bytes)
    fwd = 2 * collective_time_s("all_to_all", q_bytes, cp, H100, tp) + 2 * collective_time_s(
        "all_to_all", kv_bytes, cp, H100, tp)
    assert with_cp.cp_fwd_comm_s == pytest.approx(fwd, rel=1e-12)
    assert with_cp.cp_bwd_comm_s == pytest.approx(fwd * (2 if recompute == "full" else 1), rel=1e-12)
    replicas_excess = 2 * tokens * (kv_sent - kv_local) * 64 * 2  # 0 when split
    kept = {"none": replicas_excess + q_bytes, "selective": replicas_excess, "full": 0.0}[recompute]
    assert with_cp.activation_bytes == pytest.approx(local.activation_bytes + kept, rel=1e-12)
    for field in ("fwd_compute_s", "bwd_compute_s", "tp_fwd_comm_s", "dp_grad_comm_s", "param_bytes", "grad_bytes",
                  "optimizer_bytes", "output_bytes"):
        assert getattr(with_cp, field) == getattr(local, field), field


def test_embedding_and_head_exchange_nothing(graph):
    config = mesh(cp=4, microbatch_size=4, cp_method="ulysses")
    for name in ("embed", "head"):
        cost = layer_cost(graph.layer(name), config, H100, graph.info, profile_dtype="bf16")
        assert cost.cp_fwd_comm_s == cost.cp_bwd_comm_s == 0.0


def test_config_validates_normalises_and_labels_the_method():
    with pytest.raises(ValueError, match="cp_method must be one of all-gather, ulysses, got 'ring'"):
        ParallelConfig(gpus=2, global_batch=2, cp=2, cp_method="ring")
    # without CP the method means nothing: stored as the default, so equal layouts compare equal
    assert ParallelConfig(gpus=2, global_batch=2, dp=2, cp_method="ulysses") == ParallelConfig(gpus=2, global_batch=2,
                                                                                               dp=2)
    config = ParallelConfig(gpus=4, global_batch=2, cp=2, tp=2, cp_method="ulysses")
    assert config.mesh_label() == "pp=1 dp=1 cp=2 ulysses tp=2"
    assert ParallelConfig(gpus=4, global_batch=2, cp=2, tp=2).mesh_label() == "pp=1 dp=1 cp=2 tp=2"


def test_plan_json_records_the_method_and_older_plans_read_as_all_gather():
    from meshplan.executor.plans import uniform_plan

    spec, cpu = "gpt:layers=2,hidden=32,heads=2,vocab=64", load_cluster("cpu")
    plan = uniform_plan(spec, 16, 8, cpu, dp=2, cp=2, microbatch_size=2, cp_method="ulysses")
    data = json.loads(json.dumps(plan.to_json()))
    assert data["cp_method"] == "ulysses" and data["mesh"]["cp"] == 2
    assert plan_from_json(data).config.cp_method == "ulysses"
    gathered = uniform_plan(spec, 16, 8, cpu, dp=2, cp=2, microbatch_size=2)
    from meshplan.reports.plans import plan_facts
    from meshplan.reports.sections import CP_METHOD_TEXT, _mesh_text

    assert plan_facts(plan)["mesh (pp x dp x cp x tp)"] == "1 x 2 x 2 x 1 (ulysses)"
    assert CP_METHOD_TEXT["ulysses"] in _mesh_text(plan.config)
    assert gathered.to_json()["cp_method"] == "all-gather" and gathered.digest != plan.digest
    del data["cp_method"]  # a plan written before the key
    assert plan_from_json(data).config.cp_method == "all-gather"
    assert "cp_method" not in uniform_plan(spec, 16, 8, cpu, dp=2, microbatch_size=2).to_json()
    data["cp_method"] = "ring"
    with pytest.raises(ValueError, match="cp_method must be one of all-gather, ulysses, got 'ring'"):
        plan_from_json(data)


def test_the_search_offers_ulysses_where_the_heads_divide(odd_graph):
    from meshplan.planner.search.candidates import Pins, cp_methods, enumerate_candidates

    facts = model_facts(odd_graph)
    assert cp_methods(facts, 1, 2, None) == ["all-gather", "ulysses"]
    assert cp_methods(facts, 1, 4, None) == ["all-gather"]  # 6 heads over 4 ranks
    assert cp_methods(facts, 1, 4, "ulysses") == []
    assert cp_methods(facts, 2, 1, "ulysses") == ["all-gather"]  # no CP: the default
    methods = {(c.cp, c.cp_method) for c in enumerate_candidates(odd_graph, H100, 4, 4, Pins(tp=1, pp=1))}
    assert methods == {(1, "all-gather"), (2, "all-gather"), (2, "ulysses"), (4, "all-gather")}


def test_executability_refuses_heads_ulysses_cannot_split(odd_graph):
    facts = model_facts(odd_graph)
    ok = ParallelConfig(gpus=2, global_batch=2, cp=2, cp_method="ulysses")
    assert why_not_executable(ok, facts) is None
    bad = ParallelConfig(gpus=4, global_batch=2, cp=4, cp_method="ulysses")
    reason = why_not_executable(bad, facts)
    assert "6 heads / tp 1 = 6 are not divisible by cp 4" in reason and "\n" not in reason
    assert why_not_executable(ParallelConfig(gpus=4, global_batch=2, cp=4), facts) is None  # all-gather runs it


def test_estimate_flag_and_its_refusal(run_cli):
    args = ("estimate", "--model", SPEC, "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8", "--seq", "8192",
            "--cp", "4", "--json")
    code, out, _ = run_cli(*args, "--cp-method", "ulysses")
    assert code == 0
    ulysses_pred = json.loads(out)
    code, out, _ = run_cli(*args)
    gathered = json.loads(out)
    assert ulysses_pred["breakdown"]["cp_comm"] > 0 and ulysses_pred["breakdown"]["cp_comm"] != gathered["breakdown"][
        "cp_comm"]
    code, _, err = run_cli("estimate", "--model", SPEC, "--cluster", "h100-sxm", "--gpus", "32", "--gbs", "8",
                           "--seq", "8192", "--tp", "2", "--cp", "16", "--cp-method", "ulysses")
    assert code == 2 and "16 heads / tp 2 = 8 are not divisible by cp 16" in err and "Traceback" not in err


def test_the_search_picks_ulysses_for_long_multi_head_sequences_on_a_node():
    """A 16-layer, 2048-wide multi-head model (16 K/V heads) at 128K tokens on one H100 node: the
    all-gather method brings the whole sequence's K and V to every rank, Ulysses sends (cp-1)/cp
    of the rank's own q, k, v and output shards, a volume that shrinks as cp grows; the search
    picks Ulysses, and pinned to all-gather it finds a slower plan."""
    from meshplan.planner.search.driver import search_plan

    spec = "llama:layers=16,hidden=2048,heads=16,kv_heads=16,ffn=5632,vocab=32000"
    plan = search_plan(spec, "h100-sxm", 8, 8, 131072, top_k=2)
    assert plan.config.cp > 1 and plan.config.cp_method == "ulysses" and plan.executable
    gathered = search_plan(spec, "h100-sxm", 8, 8, 131072, top_k=2, cp_method="all-gather")
    assert gathered.config.cp_method == "all-gather" or gathered.config.cp == 1
    assert gathered.prediction["step_time_s"] > plan.prediction["step_time_s"]


def _engine_plan(**options):
    from tests.planner.engines.helpers import make_plan

    return make_plan(zero=1, pp=2, dp=1, tp=2, cp=2, **options)


def test_megatron_and_deepspeed_exports_round_trip_ulysses():
    from dataclasses import replace

    from meshplan.planner.engines.bridge import export_plan, predict_job, read_engine_text
    from meshplan.planner.simulation.simulator import simulate

    base = _engine_plan()
    plan = replace(base, config=replace(base.config, cp_method="ulysses"))
    megatron = export_plan(plan, "megatron")
    assert "--cp-comm-type a2a" in megatron.text
    assert "--cp-comm-type" not in export_plan(base, "megatron").text  # all-gather: Megatron's default kind
    for engine, exported in (("megatron", megatron), ("deepspeed", export_plan(plan, "deepspeed"))):
        assert not any("DeepSpeed-Ulysses" in note for note in exported.notes), engine
        job = read_engine_text(exported.text, engine)
        assert job.cp_method == "ulysses" and job.cp == 2, engine
        result = predict_job(job, plan.model.spec, plan.cluster, seq=plan.model.seq, gpus=plan.config.gpus)
        assert result.config.cp_method == "ulysses"
        if engine == "megatron":  # the plan as Megatron-LM runs it (its memory recipe and overlap)
            as_run = replace(plan, config=replace(plan.config, engine=result.config.engine))
            assert result.prediction.step_time_s == pytest.approx(simulate(as_run, timeline=False).step_time_s,
                                                                  rel=0.01)
    assert any("re-plan with --cp-method ulysses" in note for note in export_plan(base, "deepspeed").notes)


def test_megatron_cp_comm_types_read_back():
    from meshplan.planner.engines.megatron import read_megatron

    head = "# meshplan: gpus=8 model=" + SPEC + "\n--tensor-model-parallel-size 2 --context-parallel-size 2 "
    assert read_megatron(head + "--cp-comm-type a2a").cp_method == "ulysses"
    assert read_megatron(head + "--cp-comm-type allgather").cp_method == "all-gather"
    ring = read_megatron(head + "--cp-comm-type p2p")
    assert ring.cp_method == "all-gather" and any("--cp-comm-type p2p" in note for note in ring.notes)
    assert read_megatron(head).notes == read_megatron(head + "--cp-comm-type allgather").notes
    with pytest.raises(MeshplanError, match="--cp-comm-type must be one of"):
        read_megatron(head + "--cp-comm-type ring")


def test_torchtitan_refuses_ulysses_in_one_line():
    from dataclasses import replace

    from meshplan.planner.engines.bridge import export_plan

    base = _engine_plan()
    plan = replace(base, config=replace(base.config, cp_method="ulysses"))
    for form in ("toml", "python"):
        with pytest.raises(MeshplanError, match=r"torchtitan \(0\.2\.2 and 0\.3\.0\) has no Ulysses") as refusal:
            export_plan(plan, "torchtitan", form)
        assert "\n" not in str(refusal.value) and "--cp-method all-gather" in str(refusal.value)


def test_a_method_dominated_at_a_configuration_is_not_searched(graph):
    """Multi-head attention over 8 ranks of a node: Ulysses sends 7/8 of the rank's q, k, v and
    output, all-gather brings 7/8 of the whole sequence's K and V and keeps them (8x more bytes
    each way): all-gather is dominated. Grouped-query attention with one K/V head per TP rank
    over 2 ranks: all-gather moves and keeps a third of what Ulysses does: Ulysses is dominated."""
    from meshplan.planner.profiling.profiler import profile
    from meshplan.planner.search.candidates import dominated_cp_methods

    mha = profile("llama:layers=2,hidden=1024,heads=16,kv_heads=16,ffn=2816,vocab=32000", SEQ, dtype="bf16")
    assert dominated_cp_methods(mha, H100, mesh(cp=8, microbatch_size=1)) == {"all-gather"}
    assert dominated_cp_methods(graph, H100, mesh(tp=4, cp=2, microbatch_size=1)) == {"ulysses"}
    assert dominated_cp_methods(graph, H100, mesh(tp=1, cp=1)) == frozenset()


def test_the_search_leaves_out_exactly_the_dominated_methods(graph):
    """Enumeration decides dominance once per (tp, cp, micro-batch, SP): its candidates are every
    method's (each pinned in turn: a pinned method is searched whatever dominates it) but those
    `dominated_cp_methods` rules out at their own configuration, and both methods remain."""
    from meshplan.planner.contracts.config import CP_METHODS
    from meshplan.planner.search.candidates import Pins, dominated_cp_methods, enumerate_candidates

    searched = enumerate_candidates(graph, H100, 64, 64, Pins(), 2)
    every = [c for method in CP_METHODS for c in enumerate_candidates(graph, H100, 64, 64, Pins(cp_method=method), 2)]
    kept = {c for c in every if c.cp == 1 or c.cp_method not in dominated_cp_methods(graph, H100, c)}
    assert set(searched) == kept and len(searched) == len(kept)
    assert {c.cp_method for c in searched if c.cp > 1} == set(CP_METHODS)
    assert len(kept) < len(set(every))


def test_plan_pins_the_method_and_refuses_heads_it_cannot_split(run_cli, tmp_path):
    spec = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256"
    common = ("plan", "--model", spec, "--seq", "64", "--cluster", "cpu", "--gbs", "4")
    code, out, _ = run_cli(*common, "--gpus", "2", "--cp", "2", "--cp-method", "ulysses", "--out",
                           tmp_path / "plan.json")
    assert code == 0 and "cp=2 ulysses" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["cp_method"] == "ulysses" and data["executable"] and data["mesh"]["cp"] == 2
    code, _, err = run_cli(*common, "--gpus", "8", "--tp", "2", "--cp", "4", "--cp-method", "ulysses")
    assert code == 2 and "the 4 heads / tp 2 = 2 are not divisible by cp 4" in err and err.count("\n") == 1


def test_a_layerwise_block_takes_no_tp_ulysses_cannot_split():
    """8 heads over cp 4: a block may run at tp 1 or 2 (8 or 4 heads per TP rank), not at tp 4
    (2 heads for 4 CP ranks); the embedding and the head, which exchange nothing, may."""
    from meshplan.planner.costing.tables import build_cost_table
    from meshplan.planner.profiling.profiler import profile

    small = profile("llama:layers=2,hidden=512,heads=8,kv_heads=2,ffn=1024,vocab=4096", 8192, dtype="bf16")
    config = mesh(dp=4, cp=4, microbatch_size=4, cp_method="ulysses")
    table = build_cost_table(small, H100, config, layerwise_meshes=((1, 4), (2, 2), (4, 1)))
    tps = {layer_type.key: {option.tp for option in layer_type.options} for layer_type in table.types}
    blocks = [tp for key, tp in tps.items() if "block" in key]
    assert blocks and all(tp == {1, 2} for tp in blocks)
    assert any(4 in tp for key, tp in tps.items() if "block" not in key)
