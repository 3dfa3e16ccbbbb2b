"""Every axis both ways: CP, EP, interleaved, zbv and ZeRO-2-under-pipelining plans exported to
each engine and read back give the plan's step as the engine runs it (its overlap) within 1%, or
the export names the approximation, or the engine refuses a schedule it does not run in one line;
the engines' own loaders accept what is written."""
from __future__ import annotations

import ast
import json
import tempfile
import tomllib
from dataclasses import replace

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.engines.bridge import export_plan, predict_job, read_engine_text
from meshplan.planner.engines.torchtitan import PARALLELISM_KEYS
from meshplan.planner.simulation.simulator import simulate
from tests.planner.engines.helpers import MOE_SPEC, as_engine_runs_it, make_plan

PLANS = {
    "cp": dict(zero=1, pp=2, dp=1, tp=2, cp=2),
    "interleaved": dict(zero=1, pp=2, dp=2, tp=2, schedule="interleaved", vpp=2, counts=[1, 3, 2, 2]),
    "zbv": dict(zero=1, pp=2, dp=2, tp=2, schedule="zbv", vpp=2),
    "ep": dict(zero=1, pp=1, dp=4, tp=1, sp=False, ep=2, spec=MOE_SPEC),
    "zero2-pp": dict(zero=2, pp=2, dp=2, tp=2),  # Megatron FSDP under pipelining
}
# (plan, engine) pairs whose export is exact (no warning; within 1%); the rest below
# (interleaved, torchtitan): ZeRO-1 under a pipeline runs as ZeRO-2 there (FSDP reduce-scatters every
# micro-batch), which the lean executor's per-layer FSDP2 reductions price 1.4% apart.
EXACT = ({(plan, engine) for plan in PLANS for engine in ("torchtitan", "megatron")}
         - {("zbv", "megatron"), ("interleaved", "torchtitan")})
REFUSED = {("interleaved", "deepspeed"): "runs 1f1b only, not interleaved",
           ("zbv", "deepspeed"): "runs 1f1b only, not zbv",
           ("zbv", "megatron"): "Megatron-LM has no zbv pipeline schedule"}
NAMED = {("cp", "deepspeed"): "sequence parallelism: not a ds_config key",
         ("interleaved", "torchtitan"): "ZeRO-1: torchtitan's FSDP has no optimizer-only sharding",
         ("ep", "deepspeed"): "expert parallelism 2: ds_config has no key",
         ("zero2-pp", "deepspeed"): "ZeRO-2 with pipelining: DeepSpeed's pipeline engine supports ZeRO-1 only"}


def _round_trip(plan, engine, form=None):
    exported = export_plan(plan, engine, form)
    job = read_engine_text(exported.text, engine)
    return exported, job, predict_job(job, plan.model.spec, plan.cluster, seq=plan.model.seq, gpus=plan.config.gpus)


@pytest.mark.parametrize("name,engine", sorted((p, e) for p in PLANS for e in ("torchtitan", "megatron", "deepspeed")))
def test_round_trip_of_every_axis(name, engine):
    plan = make_plan(**PLANS[name])
    step = simulate(as_engine_runs_it(plan, engine), timeline=False).step_time_s
    if (name, engine) in REFUSED:
        with pytest.raises(MeshplanError, match=REFUSED[name, engine]) as refusal:
            export_plan(plan, engine)
        assert "\n" not in str(refusal.value)
        return
    exported, job, result = _round_trip(plan, engine)
    cfg = result.config
    assert (cfg.cp, cfg.ep, cfg.dp, cfg.tp, cfg.pp) == (plan.config.cp, plan.config.ep if (name, engine) in EXACT
                                                        else 1, plan.config.dp, plan.config.tp, plan.config.pp)
    change = result.prediction.step_time_s / step - 1
    if (name, engine) in EXACT:
        assert abs(change) <= 0.01 and exported.warnings == ()
        assert result.chunk_of_layer == tuple(plan.chunk_of(layer) for layer in plan.layers)
        assert (cfg.schedule, cfg.virtual_stages) == (plan.config.schedule, plan.config.virtual_stages)
    else:  # off by more than 1%: the approximation and the step it gives are named
        assert abs(change) > 0.01
        assert any(NAMED[name, engine] in note for note in exported.notes)
        assert len(exported.warnings) == 1 and f"{change:+.1%}" in exported.warnings[0]


def test_deepspeed_expert_parallelism_from_the_command_line():
    """ds_config cannot say EP (the model code sets it): given back, the step is the plan's."""
    plan = make_plan(**PLANS["ep"])
    exported = export_plan(plan, "deepspeed")
    job = replace(read_engine_text(exported.text, "deepspeed"), ep=2)
    result = predict_job(job, plan.model.spec, plan.cluster, seq=plan.model.seq, gpus=plan.config.gpus)
    assert result.prediction.step_time_s == pytest.approx(
        simulate(as_engine_runs_it(plan, "deepspeed"), timeline=False).step_time_s, rel=0.01)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_torchtitan_python_config_reads_as_its_toml(name):
    """torchtitan 0.3's Python config carries what the 0.2 TOML does, and only torchtitan's own
    field names (0.3's torchtitan/config/configs.py; test_torchtitan_python runs it in 0.3)."""
    plan = make_plan(**PLANS[name])
    python, job, _ = _round_trip(plan, "torchtitan", "python")
    assert job == read_engine_text(export_plan(plan, "torchtitan").text, "torchtitan")
    tree = ast.parse(python.text)
    calls = {node.func.id: {kw.arg for kw in node.keywords} for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert calls["ParallelismConfig"] <= set(PARALLELISM_KEYS)
    assert calls["TrainingConfig"] <= {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param",
                                       "mixed_precision_reduce"}
    assert "activation_checkpoint=None," in python.text  # these plans recompute nothing
    assert "def meshplan_job() -> Trainer.Config:" in python.text


def test_torchtitan_loader_accepts_cp_ep_and_zbv():
    from tests.planner.engines.test_export import _torchtitan_config_manager

    manager = _torchtitan_config_manager()
    for name in ("cp", "zbv", "ep"):
        plan = make_plan(**PLANS[name])
        text = export_plan(plan, "torchtitan").text
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as handle:
            handle.write(text)
            handle.flush()
            job = manager().parse_args(["--job.config_file", handle.name])
        par = job.parallelism
        assert (par.context_parallel_degree, par.expert_parallel_degree) == (plan.config.cp, plan.config.ep)
        if plan.config.pp > 1:
            assert par.pipeline_parallel_schedule == tomllib.loads(text)["parallelism"]["pipeline_parallel_schedule"]


def test_deepspeed_loader_accepts_a_context_parallel_batch(monkeypatch):
    """DeepSpeed divides the world by sequence_parallel_size before checking train_batch_size =
    micro-batch x accumulation x data-parallel ranks: the CP export passes its assertion."""
    plan = make_plan(zero=1, pp=1, dp=4, tp=1, sp=False, cp=2, gbs=32)
    data = json.loads(export_plan(plan, "deepspeed").text)
    assert data["sequence_parallel_size"] == 2
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *args: plan.config.gpus)
    loaded = ds_config.DeepSpeedConfig(data)
    assert loaded.world_size == plan.config.dp and loaded.train_batch_size == 32


def test_deepspeed_config_needs_the_sequence_length():
    plan = make_plan(zero=1, pp=1, dp=4, sp=False)
    job = read_engine_text(export_plan(plan, "deepspeed").text, "deepspeed")
    assert job.seq is None
    with pytest.raises(MeshplanError, match="does not give the sequence length; pass --seq N"):
        predict_job(job, plan.model.spec, plan.cluster)


def test_megatron_moe_arguments_give_the_moe_spec_back():
    from meshplan.planner.engines.megatron import read_megatron

    plan = make_plan(**PLANS["ep"])
    text = "\n".join(line for line in export_plan(plan, "megatron").text.splitlines() if not line.startswith("#"))
    job = read_megatron(text)  # without the header line: the model from its shape arguments
    assert (job.ep, job.etp) == (2, 1)
    assert job.model == MOE_SPEC + ",shared_experts=0,dense_layers=0,ffn=512,tied=0"
