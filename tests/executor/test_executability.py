"""The planner and `train` agree on what runs: every plan the search makes (winner and
alternatives) that it marks executable passes `train`'s configuration checks, and every plan it
marks not executable is refused by them with the reason it records.

One rule decides (`planner.costing.executable.why_not_executable`): the planner reads it on the
profiled graph, the executor on the model it builds. A sweep of small requests on the meta device
(dense zoo models, mixtures of experts with and without EP, a Hugging Face config, CP, HSDP, every
schedule, FP8, --layerwise) holds the two ends together; nothing starts a process.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from meshplan.executor.checks import check_plan_runnable
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.plan import LayerAssignment, Plan
from meshplan.planner.costing.executable import (LAYERWISE, ModelFacts, cp_split_problem, tp_split_problem,
                                                 why_not_executable)
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.contracts.graph import TPSplit
from meshplan.planner.search.candidates import Pins, enumerate_candidates
from meshplan.planner.search.driver import search_plan

LLAMA = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256"
GPT = "gpt:layers=4,hidden=64,heads=4,vocab=256"
MOE = "moe:layers=4,hidden=64,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=64,vocab=256"
SEQ = 64

# (name, spec, gpus, global batch, search keywords)
REQUESTS = [
    ("llama", LLAMA, 4, 8, {}),
    ("gpt", GPT, 4, 8, {}),
    ("moe", MOE, 4, 8, {}),
    ("moe ep 2", MOE, 4, 8, {"ep": 2}),
    ("moe tp 2", MOE, 4, 8, {"tp": 2}),
    ("moe tp 2 etp 1 ep 4", MOE, 4, 8, {"tp": 2, "etp": 1, "ep": 4}),
    ("moe tp 2 sp", MOE, 4, 8, {"tp": 2, "sp": True}),
    ("moe ep 2 hsdp", MOE, 8, 16, {"ep": 2, "shard_group": 2, "zero": 3, "dp": 8}),
    ("hsdp", LLAMA, 8, 16, {"shard_group": 2, "zero": 2, "dp": 8}),
    ("cp 2", LLAMA, 4, 8, {"cp": 2}),
    ("cp 2 ulysses", LLAMA, 4, 8, {"cp": 2, "cp_method": "ulysses"}),
    # 2 query heads and 1 K/V head per TP rank: Ulysses over cp 2 replicates the K/V head
    ("cp 2 tp 2 ulysses", LLAMA, 4, 8, {"cp": 2, "tp": 2, "cp_method": "ulysses"}),
    ("moe cp 2 ep 2", MOE, 4, 8, {"cp": 2, "ep": 2}),
    ("fp8", LLAMA, 4, 8, {"precision": "fp8"}),
    ("layerwise", LLAMA, 4, 8, {"layerwise": True, "pp": 1}),
    *[(f"pp 2 {schedule}", LLAMA, 4, 8, {"pp": 2, "schedule": schedule})
      for schedule in ("1f1b", "gpipe", "interleaved", "zb-interleaved", "zbv", "dualpipev")],
    ("zero 3 pp 2", LLAMA, 4, 8, {"pp": 2, "zero": 3}),
    ("sp", LLAMA, 4, 8, {"tp": 2, "sp": True}),
]


def _hf_configs(tmp_path) -> tuple[str, str]:
    """A small Llama, and a small GPT-2, whose learned positions no pipeline stage holds."""
    llama, gpt2 = tmp_path / "llama.json", tmp_path / "gpt2.json"
    llama.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "vocab_size": 256, "max_position_embeddings": 128}))
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 256,
                                "n_positions": 128}))
    return f"hf:{llama}", f"hf:{gpt2}"


def _plan(spec: str, gpus: int, global_batch: int, **kwargs) -> Plan:
    return search_plan(spec, load_cluster("h100-sxm"), gpus, global_batch, SEQ, top_k=3, num_rerank=4,
                       time_limit_s=1.0, workers=1, **kwargs)


def _alternative_plan(plan: Plan, entry: dict) -> Plan:
    """The runner-up `entry` as a plan of its own: its mesh, switches, chunks and recomputation."""
    mesh, schedule = entry["mesh"], entry["schedule"]
    config = ParallelConfig(gpus=plan.config.gpus, global_batch=plan.config.global_batch, tp=mesh["tp"],
                            pp=mesh["pp"], dp=mesh["dp"], cp=mesh.get("cp", 1), ep=mesh.get("ep", 1), etp=mesh.get("etp"),
                            microbatch_size=schedule["microbatch_size"], zero=entry["zero"], sp=entry["sp"],
                            schedule=schedule["name"], virtual_stages=schedule["virtual_stages"],
                            precision=entry["precision"], shard_group=entry.get("shard_group"),
                            recompute=entry["recompute"], cp_method=entry.get("cp_method", "all-gather"))
    layers = tuple(LayerAssignment(name=layer.name, stage=config.rank_of_chunk(chunk),
                                   virtual_stage=chunk // config.pp, tp=config.tp, dp=config.dp, recompute=recompute)
                   for layer, chunk, recompute in zip(plan.layers, entry["chunk_of_layer"],
                                                      entry["recompute_of_layer"]))
    return replace(plan, config=config, layers=layers, alternatives=(), executable=entry["executable"],
                   not_executable_reason=entry.get("not_executable_reason", ""))


def _check_agreement(plan: Plan) -> str:
    """`train`'s checks accept the plan exactly when it is marked executable; returns its reason."""
    if plan.executable:
        assert plan.not_executable_reason == ""
        check_plan_runnable(plan, plan.config.gpus)
        return ""
    reason = plan.not_executable_reason
    assert reason and "\n" not in reason
    with pytest.raises(MeshplanError) as refused:
        check_plan_runnable(plan, plan.config.gpus)
    assert reason in str(refused.value)
    if reason == LAYERWISE:
        return reason
    # The executor's own reading of the model (built on the meta device) finds the same reason
    # when the plan does not carry it: FP8 is refused first for this device.
    with pytest.raises(MeshplanError) as again:
        check_plan_runnable(replace(plan, executable=True, not_executable_reason=""), plan.config.gpus)
    if plan.config.precision == "fp8":
        assert "FP8" in str(again.value)
    else:
        assert str(again.value) == f"this plan is not executable: {reason}"
    return reason


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """{request name: [(plan, reason), ...]} over the winner and its alternatives."""
    llama, gpt2 = _hf_configs(tmp_path_factory.mktemp("hf"))
    requests = REQUESTS + [("hf llama", llama, 4, 8, {}), ("hf llama pp 2", llama, 4, 8, {"pp": 2}),
                           ("hf gpt2", gpt2, 4, 8, {}), ("hf gpt2 pp 2", gpt2, 4, 8, {"pp": 2})]
    out = {}
    for name, spec, gpus, global_batch, kwargs in requests:
        plan = _plan(spec, gpus, global_batch, **kwargs)
        plans = [plan] + [_alternative_plan(plan, entry) for entry in plan.alternatives]
        out[name] = [(p, _check_agreement(p)) for p in plans]
    return out


def test_marked_plans_agree_with_train(swept):
    reasons = [reason for plans in swept.values() for _, reason in plans]
    assert len(reasons) > len(swept) and "" in reasons and any(reasons)  # both kinds were made
    schedules = {p.config.schedule for plans in swept.values() for p, _ in plans}
    assert schedules >= {"1f1b", "gpipe", "interleaved", "zb-interleaved", "zbv", "dualpipev"}


def test_the_default_space_is_what_the_executor_runs(swept):
    for name in ("llama", "gpt", "moe", "moe ep 2", "moe tp 2", "moe tp 2 etp 1 ep 4", "moe ep 2 hsdp", "hsdp",
                 "cp 2", "cp 2 ulysses", "cp 2 tp 2 ulysses", "moe cp 2 ep 2", "hf llama", "hf llama pp 2", "hf gpt2",
                 "zero 3 pp 2", "sp", *[n for n, *_ in REQUESTS if n.startswith("pp 2 ")]):
        assert all(reason == "" for _, reason in swept[name]), name
    assert all(not p.config.sp for p, _ in swept["moe tp 2"])  # MoE blocks under TP run without SP
    assert all((p.config.expert_tp, p.config.ep) == (1, 4) for p, _ in swept["moe tp 2 etp 1 ep 4"])
    assert all(p.config.ep == 2 and p.config.cp == 2 for p, _ in swept["moe cp 2 ep 2"])
    assert all(p.config.shard_group == 2 for p, _ in swept["hsdp"])
    assert all(p.config.cp_method == "ulysses" for name in ("cp 2 ulysses", "cp 2 tp 2 ulysses")
               for p, _ in swept[name])
    assert all(p.config.pp == p.config.tp == 1 for p, _ in swept["hf gpt2"])  # no stage cut, no TP layout


@pytest.mark.parametrize("name,expected", [
    ("moe tp 2 sp", "mixture-of-experts blocks under tp=2 without sequence parallelism"),
    ("fp8", "FP8 plans are planned, not executed"),
    ("hf gpt2 pp 2", "cannot be cut into pipeline stages: its base model has parameters outside the embedding, "
                     "decoder layers and final norm (wpe)"),
])
def test_pinned_choices_the_executor_refuses_are_planned_and_marked(swept, name, expected):
    plans = swept[name]
    assert plans and all(expected in reason for _, reason in plans)


def test_a_layerwise_plan_with_its_own_degrees_is_marked(swept):
    plan, reason = swept["layerwise"][0]
    uniform = all((layer.tp, layer.dp) == (plan.config.tp, plan.config.dp) for layer in plan.layers)
    assert reason == ("" if uniform else LAYERWISE)


def _facts(**kwargs) -> ModelFacts:
    block = TPSplit(kind="block", num_heads=4, num_kv_heads=2, mlp_width=96)
    return ModelFacts(**{"spec": "m", "family": "llama", "seq": 24, "num_heads": 4,
                         "layers": (("blocks.0", "block", block), ("head", "vocab", TPSplit(kind="vocab",
                                                                                            vocab_size=256))),
                         **kwargs})


def test_split_rules_name_the_numbers():
    model = _facts()
    assert tp_split_problem(model, 2) is None and tp_split_problem(model, 1) is None
    assert tp_split_problem(model, 4) == ("tp=4 does not divide layer 'blocks.0': 4 heads, 2 KV heads, MLP width "
                                          "96; pick a tp that divides them")
    assert tp_split_problem(model, 3, "--tp 3").startswith("--tp 3 does not divide layer 'blocks.0'")
    hf = _facts(family="hf", layers=(("blocks.0", "block", TPSplit(reason="no attention")),))
    assert tp_split_problem(hf, 2) == ("tp=2: layer 'blocks.0' cannot be split over tensor-parallel ranks: no "
                                       "attention; use --tp 1")
    assert cp_split_problem(model, 4) is None  # 24 tokens in 8 chunks
    assert cp_split_problem(model, 8) == ("cp=8 cuts each sequence into 2*cp = 16 equal chunks; seq 24 is not "
                                          "divisible by 16: use a sequence length that is")
    assert "has no attention" in cp_split_problem(_facts(num_heads=0), 2)
    assert cp_split_problem(_facts(num_kv_heads=2), 2, method="ulysses", tp=2) is None  # 1 K/V head replicated
    assert "the 3 K/V heads per tensor-parallel rank" in cp_split_problem(
        _facts(num_heads=12, num_kv_heads=3), 2, method="ulysses")
    assert cp_split_problem(model, 4, method="ulysses", tp=2) == (
        "cp=4 with --cp-method ulysses gives each CP rank heads/(tp*cp) attention heads: the 4 heads / tp 2 = 2 "
        "are not divisible by cp 4; use a cp that divides 2 or --cp-method all-gather")


def test_rule_refuses_what_the_executor_does_not_run():
    llama, moe = _facts(), _facts(family="moe", num_experts=4)
    config = ParallelConfig(gpus=4, global_batch=8, dp=4)
    assert why_not_executable(config, llama) is None
    assert why_not_executable(config, llama, [(1, 4), (2, 2)]) == LAYERWISE
    assert "ZeRO-3 with the zbv schedule (pp 2, dp 2) runs as ZeRO-1" in why_not_executable(
        ParallelConfig(gpus=4, global_batch=8, pp=2, dp=2, zero=3, schedule="zbv", virtual_stages=2), llama)
    assert "sequence length divisible by 2" in why_not_executable(
        ParallelConfig(gpus=2, global_batch=8, tp=2, sp=True), _facts(seq=15))
    assert "expert parallelism (ep=2) needs a mixture-of-experts model" in why_not_executable(
        replace(config, ep=2), llama)
    assert why_not_executable(replace(config, ep=2), moe) is None
    assert why_not_executable(replace(config, ep=4), moe) is None
    assert "ep=3 must divide the 4 routed experts" in why_not_executable(
        ParallelConfig(gpus=6, global_batch=6, dp=6, ep=3), moe)
    # the folded expert layout: etp divides tp, no SP under TP, equal token slices per expert-TP group
    folded = ParallelConfig(gpus=4, global_batch=8, tp=2, dp=2, etp=1, ep=4)
    assert why_not_executable(folded, moe) is None
    assert why_not_executable(replace(folded, shard_group=2, zero=1, etp=None, ep=2), moe) is None  # EP + HSDP
    assert "etp=4 must divide tp=2" in why_not_executable(ParallelConfig(gpus=4, global_batch=4, tp=2, dp=2, etp=4), moe)
    assert "without sequence parallelism" in why_not_executable(replace(folded, sp=True), moe)
    assert "each route an equal slice of the micro-batch's 15 tokens" in why_not_executable(
        ParallelConfig(gpus=2, global_batch=2, tp=2, etp=1), _facts(family="moe", num_experts=4, seq=15))
    assert "train with cp 1" in why_not_executable(ParallelConfig(gpus=4, global_batch=8, dp=2, cp=2),
                                                   _facts(family="hf"))
    assert "data parallelism only, this plan has pp=2 tp=1" in why_not_executable(
        ParallelConfig(gpus=2, global_batch=8, pp=2, microbatch_size=4), _facts(family="file", layers=()))
    cut = _facts(family="hf", pipeline_cut_problem="cannot be cut into pipeline stages: x")
    assert why_not_executable(ParallelConfig(gpus=2, global_batch=8, pp=2, microbatch_size=4), cut) == (
        "cannot be cut into pipeline stages: x")


def test_pins_that_leave_nothing_runnable_keep_the_pinned_space():
    from meshplan.planner.profiling.profiler import profile

    cluster, graph = load_cluster("h100-sxm"), profile(MOE, SEQ)
    pinned = enumerate_candidates(graph, cluster, 4, 8, Pins(tp=2, sp=True))
    assert pinned and all(c.tp == 2 and c.sp for c in pinned)  # MoE under TP with SP: only when pinned
    default = enumerate_candidates(graph, cluster, 4, 8, Pins(tp=2))
    assert default and not any(c.sp for c in default)
    # the folded layouts; (etp 2, ep 2) is left out for (etp 1, ep 4), never slower (`expert_layouts`)
    assert {(c.expert_tp, c.ep) for c in default} == {(2, 1), (1, 2), (1, 4)}
    # EP with HSDP: offered together
    hsdp = enumerate_candidates(graph, cluster, 16, 16, Pins(zero=3, dp=16))  # HSDP over one node of 8
    assert {c.ep for c in hsdp if c.shard_group} > {1}
