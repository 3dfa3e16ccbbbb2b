"""export -> import gives back the plan's configuration, and predicts the plan's own step time
(the simulator on the same cluster, the plan run with the engine's overlap) within 1% where
nothing was approximated."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.planner.engines.bridge import export_plan, predict_job, read_engine_file, read_engine_text
from meshplan.planner.simulation.simulator import simulate
from tests.planner.engines.helpers import as_engine_runs_it, make_plan

FIXTURES = Path(__file__).parent / "fixtures"

CASES = {
    # engine: a plan every setting of which the engine expresses exactly
    "torchtitan": dict(zero=0, pp=2, counts=[4, 4], modes=["none", "full", "none", "full", "none", "full"]),
    "megatron": dict(zero=1, pp=2, counts=[3, 5], modes=["full", "none", "full", "none", "none", "none"]),
    "deepspeed": dict(zero=1, pp=2, sp=False, recompute="full"),
}


@pytest.mark.parametrize("engine", sorted(CASES))
def test_round_trip_keeps_the_configuration_and_the_step(engine):
    plan = make_plan(**CASES[engine])
    exported = export_plan(plan, engine)
    assert all("flavour" in note for note in exported.notes)  # the test model is no torchtitan flavour
    job = read_engine_text(exported.text, engine)
    estimate = predict_job(job, plan.model.spec, plan.cluster, seq=plan.model.seq)
    cfg = estimate.config
    assert (cfg.gpus, cfg.tp, cfg.pp, cfg.dp, cfg.zero, cfg.sp, cfg.microbatch_size, cfg.global_batch) == (
        plan.config.gpus, plan.config.tp, plan.config.pp, plan.config.dp, plan.config.zero, plan.config.sp,
        plan.config.microbatch_size, plan.config.global_batch)
    assert estimate.chunk_of_layer == tuple(plan.chunk_of(layer) for layer in plan.layers)
    assert estimate.recompute_of_layer == tuple(layer.recompute for layer in plan.layers)
    step = simulate(as_engine_runs_it(plan, engine), timeline=False).step_time_s
    assert estimate.prediction.step_time_s == pytest.approx(step, rel=0.01)


def test_an_approximation_is_named_and_moves_the_configuration():
    plan = make_plan(zero=1, pp=1, dp=4, counts=None)
    exported = export_plan(plan, "torchtitan")
    assert any("ZeRO-1" in note for note in exported.notes)
    job = read_engine_text(exported.text, "torchtitan")
    assert job.zero == 2


def test_engine_memory_recipes():
    """Megatron's distributed optimizer (2 + 4 + 12/d bytes per parameter) and DeepSpeed's ZeRO-1 as
    its estimator counts it (2 + (2 + 4/d) + 12/d) on the same configuration, d = 4."""
    plan = make_plan(zero=1, pp=1, dp=4, tp=2, sp=False)
    megatron = predict_job(read_engine_text(export_plan(plan, "megatron").text, "megatron"), plan.model.spec,
                           plan.cluster, seq=plan.model.seq).prediction.memory[0]
    deepspeed = predict_job(read_engine_text(export_plan(plan, "deepspeed").text, "deepspeed"), plan.model.spec,
                            plan.cluster, seq=plan.model.seq).prediction.memory[0]
    assert megatron.params == pytest.approx(deepspeed.params)
    assert megatron.grads == pytest.approx(4 / (2 + 4 / plan.config.dp) * deepspeed.grads)
    assert megatron.optimizer == pytest.approx(deepspeed.optimizer)
    assert megatron.optimizer == pytest.approx(megatron.params * 6 / plan.config.dp)


def test_torchtitan_llama3_recipes():
    job = read_engine_file(FIXTURES / "torchtitan_llama3_70b.toml")
    assert (job.model, job.tp, job.zero, job.recompute, job.seq, job.microbatch_size) == (
        "llama3-70b", 8, 3, "full", 8192, 8)
    job = read_engine_file(FIXTURES / "torchtitan_llama3_8b.toml")
    result = predict_job(job, None, "a100-80g", gpus=64)
    assert result.config.dp == 64 and result.config.global_batch == 64
    assert set(result.recompute_of_layer[1:-1]) == {"selective"}
    assert result.prediction.step_time_s > 0 and result.prediction.peak_memory_bytes > 0


def test_megatron_llama3_script():
    job = read_engine_file(FIXTURES / "megatron_llama3_8b.sh")
    assert (job.model, job.gpus, job.global_batch, job.seq, job.zero, job.precision) == (
        "llama3-8b", 8, 128, 8192, 1, "fp8")
    # no --fp8-recipe: Megatron-LM's default, Transformer Engine's delayed scaling, priced as such
    assert job.fp8_recipe == "delayed" and not any("--fp8-recipe" in note for note in job.notes)
    assert any("--sequence-parallel" in note for note in job.notes)
    result = predict_job(job, None, "h100-sxm")
    assert result.config.dp == 8 and result.config.num_microbatches == 16


@pytest.mark.parametrize("engine", ["torchtitan", "megatron"])
def test_fp8_plans_round_trip_as_fp8(engine):
    """torchtitan's Float8 converter and Megatron-LM's --fp8-format carry the fp8 recipe both ways;
    the import prices it as fp8 (on an H100 profile, which has an FP8 peak)."""
    from dataclasses import replace

    from meshplan.planner.costing.hardware import load_cluster

    base = make_plan(zero=1, pp=1, dp=4, counts=None)
    plan = replace(base, config=replace(base.config, precision="fp8"), cluster=load_cluster("h100-sxm"))
    exported = export_plan(plan, engine)
    assert ("float8" in exported.text) if engine == "torchtitan" else ("--fp8-format hybrid" in exported.text)
    job = read_engine_text(exported.text, engine)
    assert job.precision == "fp8"
    fp8 = predict_job(job, plan.model.spec, plan.cluster, seq=plan.model.seq)
    bf16 = predict_job(replace(job, precision="bf16-mixed"), plan.model.spec, plan.cluster, seq=plan.model.seq)
    assert fp8.config.precision == "fp8"
    # the recipe reached the cost model (this model is too small for fp8 GEMMs to outrun their
    # casts, so the step itself is not asserted to be faster). Memory as each engine keeps it:
    # Transformer Engine saves the Linears' inputs in fp8; torchao's Float8Linear saves them in
    # bf16 (`matmul_with_hp_or_float8_args` keeps `input_hp`)
    fp8_bytes, bf16_bytes = fp8.prediction.memory[0].activations, bf16.prediction.memory[0].activations
    assert fp8_bytes < bf16_bytes if engine == "megatron" else fp8_bytes == bf16_bytes
    assert fp8.prediction.step_time_s != bf16.prediction.step_time_s


@pytest.mark.parametrize("engine, recipe, written, read_back", [
    ("megatron", "delayed", "--fp8-recipe delayed", "delayed"),
    ("megatron", "tensorwise", "--fp8-recipe tensorwise", "tensorwise"),
    ("megatron", "rowwise", "--fp8-recipe tensorwise", "tensorwise"),  # Megatron-LM has no rowwise
    ("torchtitan", "rowwise", 'recipe_name = "rowwise"', "rowwise"),
    ("torchtitan", "tensorwise", "enable_fsdp_float8_all_gather = true", "tensorwise"),
    ("torchtitan", "delayed", "enable_fsdp_float8_all_gather = true", "tensorwise"),  # torchtitan has no delayed
])
def test_exports_write_the_fp8_recipe_and_read_it_back(engine, recipe, written, read_back):
    from dataclasses import replace

    from meshplan.planner.costing.hardware import load_cluster

    base = make_plan(zero=1, pp=1, dp=4, counts=None)
    plan = replace(base, config=replace(base.config, precision="fp8", fp8_recipe=recipe),
                   cluster=load_cluster("h100-sxm"))
    exported = export_plan(plan, engine)
    assert written in exported.text
    assert any(f"fp8 recipe {recipe}:" in note for note in exported.notes) == (recipe != read_back)
    assert read_engine_text(exported.text, engine).fp8_recipe == read_back
    if recipe == "rowwise" and engine == "torchtitan":  # torchtitan refuses fp8 all-gather beside recipe_name
        assert "enable_fsdp_float8_all_gather = false" in exported.text


def test_deepspeed_export_names_the_fp8_approximation():
    from dataclasses import replace

    base = make_plan(zero=1, pp=1, dp=4)
    plan = replace(base, config=replace(base.config, precision="fp8"))
    exported = export_plan(plan, "deepspeed")
    assert any(note.startswith("fp8: ds_config has no FP8") for note in exported.notes)
    assert '"enabled": true' in exported.text


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchtitan_03_python_config_runs_rowwise_float8(recipe):
    """torchtitan 0.3's Float8LinearConverter has rowwise scaling only (its recipe_name default):
    a tensorwise plan is exported as rowwise, said in a note, and read back as rowwise."""
    from dataclasses import replace

    from meshplan.planner.costing.hardware import load_cluster

    base = make_plan(zero=1, pp=1, dp=4, counts=None)
    plan = replace(base, config=replace(base.config, precision="fp8", fp8_recipe=recipe),
                   cluster=load_cluster("h100-sxm"))
    exported = export_plan(plan, "torchtitan", form="python")
    # the head stays bf16 as meshplan prices it: 0.3's converter converts every Linear it is not told to skip
    assert "converters=[Float8LinearConverter.Config(filter_fqns=['lm_head'])]" in exported.text
    assert any(note.startswith("fp8 recipe tensorwise: torchtitan 0.3's") for note in exported.notes) == (
        recipe == "tensorwise")
    assert read_engine_text(exported.text, "torchtitan").fp8_recipe == "rowwise"


@pytest.mark.parametrize("form", ["toml", "python"])
def test_an_fp8_filter_travels_to_torchtitan_and_back(form):
    """A plan's fp8 filter is exported as torchtitan's filter_fqns (its module names, the head
    first, auto as auto_filter_small_kn) and read back as the same filter, the head unnoted."""
    from meshplan.planner.costing.hardware import load_cluster

    base = make_plan(zero=1, pp=1, dp=4, counts=None)
    plan = replace(base, config=replace(base.config, precision="fp8", engine="torchtitan", fp8_recipe="rowwise",
                                        fp8_filter=("auto", "k", "v")), cluster=load_cluster("h100-sxm"))
    exported = export_plan(plan, "torchtitan", form=form)
    head = "output" if form == "toml" else "lm_head"
    assert all(name in exported.text for name in (head, "auto_filter_small_kn", "attention.wk", "attention.wv"))
    job = read_engine_text(exported.text, "torchtitan")
    assert job.fp8_filter == ("auto", "k", "v")
    assert not any("filter_fqns" in note for note in job.notes)


@pytest.mark.parametrize("engine,tp_overlap", [("megatron", False), ("torchtitan", True)])
def test_a_plan_s_own_tp_overlap_travels_both_ways(engine, tp_overlap):
    """A plan that sets its TP overlap apart from the engine's record (Megatron-LM without
    --tp-comm-overlap, torchtitan with async TP) is exported with it and read back with it: the same
    configuration and the plan's own step within 1%."""
    plan = make_plan(**CASES[engine])
    plan = replace(plan, config=replace(plan.config, engine=engine, tp_comm_overlap=tp_overlap))
    exported = export_plan(plan, engine)
    assert ("--tp-comm-overlap" in exported.text) is (engine == "megatron" and tp_overlap)
    assert ("enable_async_tensor_parallel = true" in exported.text) is (engine == "torchtitan")
    job = read_engine_text(exported.text, engine)
    assert job.tp_comm_overlap is tp_overlap
    estimate = predict_job(job, plan.model.spec, plan.cluster, seq=plan.model.seq)
    assert estimate.config.tp_comm_overlap is tp_overlap
    step = simulate(plan, timeline=False).step_time_s
    assert estimate.prediction.step_time_s == pytest.approx(step, rel=0.01)
    assert step != pytest.approx(simulate(as_engine_runs_it(make_plan(**CASES[engine]), engine),
                                          timeline=False).step_time_s, rel=0.001)


def test_a_megatron_command_without_tp_overlap_blocks_on_its_tp_collectives():
    """Megatron-LM's --tp-comm-overlap is off unless named: a hand-written command with TP and SP but
    without it is priced blocking, and the missing gradient and parameter overlaps are named."""
    text = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            "--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 --global-batch-size 8 --bf16")
    job = read_engine_text(text, "megatron")
    assert job.tp_comm_overlap is False
    assert any("no --overlap-grad-reduce: priced with it" in note for note in job.notes)
    with_flag = read_engine_text(text + " --tp-comm-overlap --overlap-grad-reduce --overlap-param-gather", "megatron")
    assert with_flag.tp_comm_overlap is True and not any("--overlap" in note for note in with_flag.notes)


def test_an_engine_config_takes_the_command_lines_early_stop():
    """`estimate --from` a torchtitan config with full recomputation: `--recompute-early-stop off`
    (`EngineJob.recompute_early_stop`) prices the whole block rerun, more recompute time than
    torchtitan's default early stop; on a Megatron-LM script, asking for it is refused."""
    from dataclasses import replace

    from meshplan.planner.contracts.errors import MeshplanError

    job = replace(read_engine_file(FIXTURES / "torchtitan_llama3_70b.toml"), tp=1, sp=False, zero=1)
    spec, kwargs = "llama:layers=4,hidden=512,heads=8,kv_heads=4,ffn=1024,vocab=1024", dict(gpus=8, seq=512)
    default = predict_job(job, spec, "h100-sxm", **kwargs)
    whole = predict_job(replace(job, recompute_early_stop=False), spec, "h100-sxm", **kwargs)
    assert default.config.recompute == "full" and whole.config.recompute_early_stop is False
    assert whole.prediction.breakdown["recompute"] > default.prediction.breakdown["recompute"] > 0
    megatron = replace(read_engine_file(FIXTURES / "megatron_llama3_8b.sh"), recompute="full",
                       recompute_early_stop=True)
    with pytest.raises(MeshplanError, match="reentrant"):
        predict_job(megatron, spec, "h100-sxm", seq=512)
