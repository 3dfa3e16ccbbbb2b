"""Each export parsed by the engine's own loader (where installed) or checked against the engine's
argument names; the approximations are named."""
from __future__ import annotations

import importlib.util
import json
import sys
import tomllib
import types
from dataclasses import replace

import pytest

from meshplan.planner.engines.bridge import export_plan
from meshplan.planner.engines.launch_script import parse_arguments
from meshplan.planner.engines.torchtitan import PARALLELISM_KEYS
from tests.planner.engines.helpers import as_engine_runs_it, make_plan

# Megatron-LM's argument names that meshplan writes, as megatron/training/arguments.py defines them
# (NVIDIA/Megatron-LM, commit 307dcf37f03d44da131ba21999278abe4112d2ad); megatron.training is not
# installable from PyPI (megatron-core ships megatron.core only).
MEGATRON_ARGUMENTS = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--vocab-size", "--swiglu",
    "--normalization", "--position-embedding-type", "--rotary-base", "--disable-bias-linear",
    "--group-query-attention", "--num-query-groups", "--untie-embeddings-and-output-weights",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--sequence-parallel",
    "--context-parallel-size", "--expert-model-parallel-size", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--micro-batch-size", "--global-batch-size", "--seq-length",
    "--max-position-embeddings", "--use-distributed-optimizer", "--bf16", "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy", "--expert-tensor-parallel-size", "--num-distributed-optimizer-instances",
    "--pipeline-model-parallel-layout", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size", "--moe-layer-freq",
    "--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather",
    "--kv-channels", "--norm-epsilon", "--add-qkv-bias", "--qk-layernorm", "--moe-token-dispatcher-type",
}
# Later ones: TransformerConfig.moe_shared_expert_gate as an argument (Megatron-LM commit d98e8a64dd,
# tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp1_gdn/model_config.yaml passes it).
MEGATRON_ARGUMENTS_LATER = {"--moe-shared-expert-gate"}


def _torchtitan_config_manager():
    """torchtitan's ConfigManager without the package's __init__ (which imports GPU kernels)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan is not installed (`make install` adds torchtitan 0.2.2 without its dependencies)")
    from importlib.metadata import version

    if tuple(int(part) for part in version("torchtitan").split(".")[:2]) >= (0, 3):
        pytest.skip(f"torchtitan {version('torchtitan')} replaced the TOML job file by Python config registries; "
                    "the export is torchtitan 0.2's job TOML (pip install --no-deps 'torchtitan==0.2.2' tyro)")
    if "torchtitan" not in sys.modules:
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec  # so that the next find_spec (another test) finds it
        sys.modules["torchtitan"] = package
    try:
        from torchtitan.config import ConfigManager
    except ImportError as exc:
        pytest.skip(f"torchtitan's config loader cannot be imported here: {exc}")
    return ConfigManager


def test_torchtitan_export_loads_in_torchtitan(tmp_path):
    plan = make_plan(zero=3, pp=2, modes=["none", "full", "none", "full", "none", "full"])
    exported = export_plan(plan, "torchtitan")
    data = tomllib.loads(exported.text)
    assert set(data["parallelism"]) <= set(PARALLELISM_KEYS)
    assert data["parallelism"]["module_fqns_per_model_part"][0][0] == "tok_embeddings"
    assert data["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}
    path = tmp_path / "job.toml"
    path.write_text(exported.text)
    job = _torchtitan_config_manager()().parse_args(["--job.config_file", str(path)])
    assert job.parallelism.tensor_parallel_degree == 2 and job.parallelism.pipeline_parallel_degree == 2
    assert job.parallelism.data_parallel_shard_degree == 2
    assert job.training.local_batch_size == 16 and job.training.global_batch_size == 32
    assert job.parallelism.pipeline_parallel_microbatch_size == 2


def test_torchtitan_fp8_export_with_a_filter_loads_in_torchtitan(tmp_path):
    """The Float8 table of a filtered rowwise plan is torchtitan 0.2's ([quantize.linear.float8], the
    converter registered under that name): its filter_fqns keep the head and name the plan's
    Linears as torchtitan's module_filter_fn matches them."""
    from meshplan.planner.costing.hardware import load_cluster

    base = make_plan(zero=1, pp=1, dp=4, counts=None)
    plan = replace(base, config=replace(base.config, precision="fp8", engine="torchtitan", fp8_recipe="rowwise",
                                        fp8_filter=("auto", "k", "v")), cluster=load_cluster("h100-sxm"))
    path = tmp_path / "job.toml"
    path.write_text(export_plan(plan, "torchtitan").text)
    job = _torchtitan_config_manager()().parse_args(["--job.config_file", str(path)])
    assert job.model.converters == ["quantize.linear.float8"]
    float8 = job.quantize.linear.float8
    assert float8.recipe_name == "rowwise"
    assert float8.filter_fqns == ["output", "auto_filter_small_kn", "attention.wk", "attention.wv"]


def test_megatron_export_uses_megatron_argument_names():
    plan = make_plan(counts=[3, 5], modes=["full", "none", "full", "none", "none", "none"])
    exported = export_plan(plan, "megatron")
    flags = parse_arguments(exported.text)
    assert set(flags) <= MEGATRON_ARGUMENTS
    assert flags["--decoder-first-pipeline-num-layers"] == "2" and flags["--decoder-last-pipeline-num-layers"] == "4"
    assert flags["--recompute-method"] == "block" and flags["--recompute-num-layers"] == "1"
    assert exported.notes == ()


def test_megatron_export_turns_on_the_overlap_megatron_is_priced_with():
    """`--engine megatron` prices Megatron-Bridge's overlap (`contracts.overlap`): the export asks for it."""
    flags = parse_arguments(export_plan(make_plan(tp=2, sp=True, zero=1, dp=2), "megatron").text)
    assert {"--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather"} <= set(flags)
    flags = parse_arguments(export_plan(make_plan(tp=2, sp=False, zero=0, dp=2), "megatron").text)
    assert "--tp-comm-overlap" not in flags and "--overlap-param-gather" not in flags  # needs SP; no dist. optimizer
    assert "--overlap-grad-reduce" in flags


def test_megatron_export_of_zero3_is_megatron_fsdp():
    flags = parse_arguments(export_plan(make_plan(zero=3, pp=1, dp=4), "megatron").text)
    assert set(flags) <= MEGATRON_ARGUMENTS
    assert "--use-megatron-fsdp" in flags and flags["--data-parallel-sharding-strategy"] == "optim_grads_params"


@pytest.mark.parametrize("zero, strategy", [(2, "optim_grads"), (3, "optim_grads_params")])
def test_megatron_export_of_sharded_gradients_with_pipelining_reads_back(zero, strategy):
    """ZeRO-2/3 under pipelining is Megatron FSDP too, as `--engine megatron` prices it (gradients
    sharded over the data ranks) and as the reader takes it back: the round trip keeps the stage
    and writes no approximation."""
    from meshplan.planner.engines.megatron import read_megatron

    exported = export_plan(make_plan(zero=zero, pp=2, dp=2), "megatron")
    flags = parse_arguments(exported.text)
    assert "--use-megatron-fsdp" in flags and flags["--data-parallel-sharding-strategy"] == strategy
    assert not any("ZeRO" in note for note in exported.notes)
    job = read_megatron(exported.text)
    assert (job.zero, job.pp) == (zero, 2)


def test_megatron_export_of_an_uneven_interleaved_cut_is_its_layout():
    """A cut that uneven first/last stages cannot express is written as Megatron-Core's
    --pipeline-model-parallel-layout (chunks in model order) and read back exactly."""
    from meshplan.planner.engines.megatron import read_megatron

    plan = make_plan(zero=1, schedule="interleaved", vpp=2, counts=[1, 3, 2, 2], gbs=32)
    exported = export_plan(plan, "megatron")
    flags = parse_arguments(exported.text)
    assert set(flags) <= MEGATRON_ARGUMENTS and exported.notes == ()
    assert flags["--pipeline-model-parallel-layout"] == "E|ttt|tt|tL"
    assert read_megatron(exported.text).layers_per_chunk == (1, 3, 2, 2)
    assert read_megatron("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*2|(tt|)*2tL'"
                         ).layers_per_chunk == (3, 2, 2, 2)


def test_deepspeed_export_loads_in_deepspeed(monkeypatch):
    plan = make_plan(pp=2, zero=1, recompute="full", sp=False)
    exported = export_plan(plan, "deepspeed")
    data = json.loads(exported.text)
    assert data["train_batch_size"] == 32 and data["gradient_accumulation_steps"] == 8
    assert data["pipeline"]["stages"] == 2 and data["pipeline"]["activation_checkpoint_interval"] == 1
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import config as ds_config

    class DataParallel:  # the data-parallel size DeepSpeed checks the batch keys against
        @staticmethod
        def get_data_parallel_world_size():
            return plan.config.dp

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    loaded = ds_config.DeepSpeedConfig(data, mpu=DataParallel())
    assert loaded.train_batch_size == 32 and loaded.zero_optimization_stage == 1
    assert loaded.bfloat16_config.enabled and loaded.pipeline["stages"] == 2


def test_every_engine_refuses_a_layerwise_plan():
    from dataclasses import replace

    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.costing.executable import LAYERWISE

    plan = replace(make_plan(), executable=False, not_executable_reason=LAYERWISE)
    with pytest.raises(MeshplanError, match="not executable"):
        export_plan(plan, "megatron")


def test_folded_moe_layout_exports_expert_tp_and_ep():
    """MoE parallel folding: expert TP 1 and EP 8 over the tp x dp ranks of each stage."""
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.costing.hardware import load_cluster

    spec = "moe:layers=4,hidden=256,heads=8,kv_heads=4,experts=8,top_k=2,expert_ffn=256,vocab=1024"
    plan = uniform_plan(spec, 128, 32, load_cluster("h100-sxm"), tp=2, dp=4, ep=8, etp=1, precision="bf16-mixed")
    flags = parse_arguments(export_plan(plan, "megatron").text)
    assert flags["--expert-model-parallel-size"] == "8" and flags["--expert-tensor-parallel-size"] == "1"
    assert flags["--tensor-model-parallel-size"] == "2"
    parallelism = tomllib.loads(export_plan(plan, "torchtitan").text)["parallelism"]
    assert (parallelism["expert_parallel_degree"], parallelism["expert_tensor_parallel_degree"]) == (8, 1)
    default = uniform_plan(spec, 128, 32, load_cluster("h100-sxm"), tp=2, dp=4, ep=2, precision="bf16-mixed")
    assert parse_arguments(export_plan(default, "megatron").text)["--expert-tensor-parallel-size"] == "2"


def test_torchtitan_export_says_when_the_plan_turned_the_early_stop_off():
    """A plan priced without torch's checkpoint early stop (`recompute_early_stop` false) exports to
    torchtitan, whose checkpoint wrapper always stops early, with a note saying so; with the
    engine's default, no such note."""
    from meshplan.planner.engines.torchtitan import export_torchtitan

    plan = as_engine_runs_it(make_plan(recompute="full"), "torchtitan")
    _, notes = export_torchtitan(plan)
    assert not any("early stop" in note for note in notes)
    off = replace(plan, config=replace(plan.config, recompute_early_stop=False))
    _, notes = export_torchtitan(off)
    assert any(note.startswith("recompute early stop off") for note in notes), notes


def test_qwen3_moe_preset_exports_its_attention_and_torchtitan_flavour():
    """Qwen3-30B-A3B: 32 heads of 128 over a hidden size of 2048 with q/k norms. Megatron-LM gets
    --kv-channels 128 and --qk-layernorm (without them it builds heads of 2048 / 32 = 64); torchtitan
    gets its own qwen3 "30B-A3B" flavour, which reads back as the preset."""
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.engines.torchtitan import read_torchtitan

    plan = uniform_plan("qwen3-30b-a3b", 4096, 64, load_cluster("h100-sxm"), dp=8, ep=8, precision="bf16-mixed")
    flags = parse_arguments(export_plan(plan, "megatron").text)
    assert set(flags) <= MEGATRON_ARGUMENTS | MEGATRON_ARGUMENTS_LATER
    assert (flags["--kv-channels"], flags["--norm-epsilon"]) == ("128", "1e-06") and "--qk-layernorm" in flags
    text = export_plan(plan, "torchtitan").text
    assert tomllib.loads(text)["model"] == {"name": "qwen3", "flavor": "30B-A3B"}
    assert read_torchtitan(text).model == "qwen3-30b-a3b"


@pytest.mark.parametrize("preset, flavour", [("deepseek-v2-lite", ["deepseek_v3", "16B"]),
                                             ("gpt-oss-20b", ["gpt_oss", "20b"])])
def test_published_config_presets_export_as_torchtitans_own_flavours(preset, flavour):
    """The published-config presets are torchtitan models of their own (not llama3 'custom'), and
    read back as the presets."""
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.engines.torchtitan import read_torchtitan

    plan = uniform_plan(preset, 1024, 8, load_cluster("h100-sxm"), dp=8, precision="bf16-mixed")
    text = export_plan(plan, "torchtitan").text
    assert list(tomllib.loads(text)["model"].values()) == flavour
    assert read_torchtitan(text).model == preset


@pytest.mark.parametrize("compile_table, model, loss", [
    ("enable = true", True, True),                             # torchtitan 0.2's components: model and loss
    ('enable = true\ncomponents = ["model"]', True, False),     # the model alone
    ('enable = true\ncomponents = ["loss"]', False, True),      # the loss alone: the blocks run eagerly
    ("enable = false", False, None)])
def test_torchtitan_compile_components(compile_table, model, loss):
    """`[compile] components`: the model is priced compiled where "model" is among them, the loss
    where "loss" is (`compile_loss`), and the plan's export writes them back; `disable_loss_parallel
    = true` is named as not modelled (meshplan prices the loss vocab-parallel under TP)."""
    from meshplan.planner.engines.bridge import predict_job
    from meshplan.planner.engines.torchtitan import read_torchtitan

    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nseq_len = 2048\n'
            '[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n'
            f'disable_loss_parallel = true\n[compile]\n{compile_table}\n')
    job = read_torchtitan(text)
    assert (job.torch_compile, job.compile_loss) == (model, loss)
    assert any(n.startswith("[parallelism] disable_loss_parallel = True: not modelled") for n in job.notes)
    result = predict_job(job, None, "h100-sxm", gpus=8)
    assert result.config.compile_loss == (None if loss == model or loss is None else loss)
    plan = make_plan(tp=2, pp=1, dp=2, gbs=8)
    plan = replace(plan, config=replace(plan.config, engine="torchtitan", torch_compile=model, compile_loss=loss))
    components = tomllib.loads(export_plan(plan, "torchtitan").text).get("compile", {}).get("components")
    assert components == ([name for name, on in (("model", model), ("loss", loss)) if on] or None)


def test_torchtitan_compile_components_refused():
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.engines.torchtitan import read_torchtitan

    with pytest.raises(MeshplanError, match="components must list"):
        read_torchtitan('[model]\nname = "llama3"\nflavor = "8B"\n[compile]\nenable = true\ncomponents = ["loss", "optimizer"]\n')
