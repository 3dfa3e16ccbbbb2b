"""The published-config presets (`registry.PUBLISHED_CONFIGS`): DeepSeek-V3, DeepSeek-V2-Lite,
GPT-OSS 20B and 120B by name, traced through transformers' model from the config shipped with
meshplan. Their counts are held to the published figures and to transformers' own model, and every
command takes them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.planner.models.registry import (PUBLISHED_CONFIGS, PUBLISHED_DIR, build_model, hf_config_path,
                                              is_moe_spec, known_models, parse_spec)
from meshplan.planner.profiling.profiler import profile

FIXTURES = Path(__file__).parent / "hf_configs"

# (total, active, their precision: one unit of the last published digit, routed experts, top-k,
# leading dense layers). Active parameters as the sources count them: all but the input
# embedding, which a token reads one row of (the output head counts).
# DeepSeek-V3 Technical Report (arXiv 2412.19437), abstract: 671 B total, 37 B activated per token,
# 3 dense layers then MoE layers of 1 shared + 256 routed experts, top-8; the multi-token prediction
# module (num_nextn_predict_layers 1, 14 B in the 685 B checkpoint) is not in transformers' model and
# not counted. DeepSeek-V2 (arXiv 2405.04434) Appendix B and the DeepSeek-V2-Lite model card: 15.7 B
# total, 2.4 B activated, 1 dense layer, 2 shared + 64 routed experts, top-6. gpt-oss-120b &
# gpt-oss-20b model card (OpenAI, arXiv 2508.10925) Table 1: 116.83 B / 5.13 B active, 20.91 B /
# 3.61 B active; 128 and 32 experts, top-4.
PUBLISHED = {
    "deepseek-v3": (671e9, 37e9, 1e9, 256, 8, 3),
    "deepseek-v2-lite": (15.7e9, 2.4e9, 0.1e9, 64, 6, 1),
    "gpt-oss-20b": (20.91e9, 3.61e9, 0.01e9, 32, 4, 0),
    "gpt-oss-120b": (116.83e9, 5.13e9, 0.01e9, 128, 4, 0),
}
# The hf: test fixtures of these models are links to the presets' package data (one copy).
FIXTURE_OF = {"deepseek-v3": "deepseek_v3.json", "deepseek-v2-lite": "deepseek_v2_lite.json",
              "gpt-oss-20b": "gpt_oss_20b.json"}


def test_every_published_preset_is_listed_and_known():
    assert set(PUBLISHED) == set(PUBLISHED_CONFIGS)
    assert set(PUBLISHED) <= set(known_models())
    assert all(is_moe_spec(name) for name in PUBLISHED)
    assert hf_config_path("deepseek-v3") == str(PUBLISHED_DIR / "deepseek_v3.json")
    assert hf_config_path("hf:x/config.json") == "x/config.json" and hf_config_path("llama3-8b") is None
    for name, fixture in FIXTURE_OF.items():
        assert (FIXTURES / fixture).resolve() == (PUBLISHED_DIR / PUBLISHED_CONFIGS[name]).resolve()


def _transformers_counts(name: str) -> tuple[int, int, int]:
    """(total, routed experts', input embedding) parameters of transformers' own model of the
    shipped config, built on the meta device without meshplan."""
    import torch
    import transformers

    data = json.loads(Path(hf_config_path(name)).read_text())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**data))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total, experts, model.get_input_embeddings().weight.numel()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_counts_match_the_published_figures_and_transformers(name):
    pytest.importorskip("transformers")
    total, active, unit, experts, top_k, dense = PUBLISHED[name]
    graph = profile(name, 256)
    info = graph.info
    assert (info.num_experts, info.top_k, info.dense_layers) == (experts, top_k, dense)
    their_total, their_experts, embedding = _transformers_counts(name)
    assert graph.total_params == their_total
    # routed experts count k / E of their parameters per token
    assert graph.active_params == their_total - their_experts + their_experts * top_k // experts
    assert abs(graph.total_params - total) <= unit, graph.total_params
    assert abs(graph.active_params - embedding - active) <= unit, graph.active_params - embedding


def test_deepseek_v3_layers_and_gpt_oss_alternating_windows():
    pytest.importorskip("transformers")
    v3 = profile("deepseek-v3", 256)
    blocks = [layer for layer in v3.layers if layer.kind == "block"]
    assert len(blocks) == 61
    assert [bool(layer.expert_params) for layer in blocks] == [False] * 3 + [True] * 58
    # its node-limited routing (n_group 8, topk_group 4), which DeepEP's traffic follows
    assert (v3.info.moe_router_groups, v3.info.moe_router_group_topk) == (8, 4)
    oss = profile("gpt-oss-120b", 256)
    blocks = [layer for layer in oss.layers if layer.kind == "block"]
    assert len(blocks) == 36
    # sliding (128) and full attention alternate: two layer types, every other layer repeats one
    assert [layer.repeat_of for layer in blocks[:4]] == [None, None, "blocks.0", "blocks.1"]
    assert any("sliding windows (128 tokens)" in note for note in oss.info.notes)
    assert (oss.info.moe_router_groups, oss.info.moe_router_group_topk) == (1, 0)  # no group limit


def test_the_published_presets_are_no_longer_refused():
    assert all(parse_spec(name, 64) is None for name in PUBLISHED)  # not zoo shapes: transformers builds them
    pytest.importorskip("transformers")
    built = build_model("deepseek-v2-lite", 16)
    assert built.info.family == "hf" and built.info.num_experts == 64


def test_deepseek_v2_lite_plans_exports_reports_and_estimates(run_cli, tmp_path):
    pytest.importorskip("transformers")
    plan_path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", "--model", "deepseek-v2-lite", "--cluster", "h100-sxm", "--gpus", 4,
                             "--gbs", 8, "--seq", 256, "--pp", 1, "--zero", 3, "--out", plan_path, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["model"]["spec"] == "deepseek-v2-lite" and plan["executable"]
    assert plan["model_graph"]["info"]["num_experts"] == 64  # carried: reading the plan traces nothing
    assert plan["prediction"]["step_time_s"] > 0
    code, out, err = run_cli("export", "--plan", plan_path, "--to", "megatron")
    assert code == 0, err
    for line in ("--num-layers 27", "--multi-latent-attention", "--kv-lora-rank 512", "--qk-pos-emb-head-dim 64",
                 "--num-experts 64", "--moe-router-topk 6", "--moe-ffn-hidden-size 1408",
                 "--moe-shared-expert-intermediate-size 2816", "--moe-layer-freq '([0]*1+[1]*26)'"):
        assert line in out.splitlines(), (line, out)
    assert "--q-lora-rank" not in out  # V2-Lite projects q at full rank
    code, _, err = run_cli("report", "--plan", plan_path, "--out", tmp_path / "report.html")
    assert code == 0, err
    assert "deepseek-v2-lite" in (tmp_path / "report.html").read_text()
    code, out, err = run_cli("estimate", "--model", "deepseek-v2-lite", "--cluster", "h100-sxm", "--gpus", 4,
                             "--gbs", 8, "--seq", 256, "--tp", 1, "--pp", 1, "--zero", 3, "--json")
    assert code == 0, err
    assert json.loads(out)["step_time_s"] > 0


@pytest.mark.parametrize("name", ["deepseek-v3", "gpt-oss-20b"])
def test_memory_and_estimate_take_the_big_presets(run_cli, name):
    pytest.importorskip("transformers")
    code, out, err = run_cli("memory", "--model", name, "--seq", 256, "--json")
    assert code == 0, err
    assert json.loads(out)
    code, out, err = run_cli("estimate", "--model", name, "--cluster", "h100-sxm", "--gpus", 64, "--gbs", 64,
                             "--seq", 256, "--tp", 1, "--pp", 4, "--ep", 8, "--zero", 1, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["step_time_s"] > 0 and result["model_tflops_per_gpu"] > 0


def test_megatron_arguments_of_deepseek_v3_and_gpt_oss():
    from meshplan.planner.engines.megatron_hf import hf_megatron_args

    notes: list[str] = []
    args = dict(hf_megatron_args(hf_config_path("deepseek-v3"), notes))
    assert (args["--q-lora-rank"], args["--kv-lora-rank"], args["--v-head-dim"]) == (1536, 512, 128)
    assert (args["--num-experts"], args["--moe-router-topk"], args["--moe-shared-expert-intermediate-size"]) == \
        (256, 8, 2048)
    assert args["--moe-layer-freq"] == "'([0]*3+[1]*58)'" and args["--moe-router-score-function"] == "sigmoid"
    assert (args["--moe-router-num-groups"], args["--moe-router-group-topk"]) == (8, 4)
    assert args["--moe-router-topk-scaling-factor"] == 2.5 and "--moe-router-enable-expert-bias" in args
    assert "--mtp-num-layers" not in args  # the plan's, written by the export (`megatron_split.mtp_args`)
    from types import SimpleNamespace

    from meshplan.planner.engines.megatron_split import mtp_args

    plan_notes: list[str] = []
    assert mtp_args(SimpleNamespace(model=SimpleNamespace(spec="deepseek-v3", mtp_num_layers=0)), plan_notes) == []
    assert any("names 1 multi-token-prediction layer" in note for note in plan_notes)
    notes = []
    args = dict(hf_megatron_args(hf_config_path("gpt-oss-120b"), notes))
    assert (args["--num-layers"], args["--num-experts"], args["--moe-router-topk"], args["--num-query-groups"]) == \
        (36, 128, 4, 8)
    assert "--disable-bias-linear" not in args and "--multi-latent-attention" not in args
    assert any("sliding windows (128 tokens" in note for note in notes)
    assert hf_megatron_args(str(FIXTURES / "llama3_8b.json"), []) is None
    assert hf_megatron_args(str(FIXTURES / "no_such_config.json"), []) is None  # a moved hf: file: no arguments


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_megatron_arguments_read_back_as_the_preset(name):
    """A launch without meshplan's header line: the model arguments name the preset again."""
    from meshplan.planner.engines.megatron import read_megatron
    from meshplan.planner.engines.megatron_hf import hf_megatron_args

    lines = [flag if value is None else f"{flag} {value}" for flag, value in hf_megatron_args(hf_config_path(name), [])]
    text = "\n".join(lines + ["--tensor-model-parallel-size 1", "--pipeline-model-parallel-size 1",
                              "--micro-batch-size 1", "--global-batch-size 64", "--seq-length 4096"])
    assert read_megatron(text).model == name
    # a shallower proxy with latent attention is no preset and no zoo shape: the model is asked for
    proxy = read_megatron(text.replace("--num-layers ", "--num-layers 1"))
    assert proxy.model is None and any("latent attention" in n or "no shape" in n for n in proxy.notes)


def test_data_reads_the_vocabulary_of_a_published_preset():
    pytest.importorskip("transformers")  # the vocabulary transformers reads from the config
    from meshplan.executor.data import token_vocab

    assert token_vocab("gpt-oss-20b", 64) == 201088 and token_vocab("deepseek-v3", 64) == 129280


def test_deepseek_v3_blocks_against_their_shapes():
    """The traced blocks of DeepSeek-V3, counted by hand from its config: multi-head latent attention
    (q down 7168 -> 1536, its norm, q up to 128 heads of 128 + 64; the K/V latent 512 + the shared
    rotary key 64, its norm, K/V up to 128 heads of 128 + 128; o from 128 x 128), two RMSNorms,
    then the dense SwiGLU (18432) or the router (256 experts), one shared expert and 256 routed
    experts (2048 each), 8 of which each token runs."""
    pytest.importorskip("transformers")
    hidden, heads, seq = 7168, 128, 256
    mla = (hidden * 1536 + 1536 + 1536 * heads * (128 + 64) + hidden * (512 + 64) + 512
           + 512 * heads * (128 + 128) + heads * 128 * hidden)
    swiglu = 3 * hidden  # per unit of width: gate, up, down
    graph = profile("deepseek-v3", seq)
    dense, moe = graph.layer("blocks.0"), graph.layer("blocks.3")
    assert dense.num_params == mla + 2 * hidden + swiglu * 18432
    assert moe.expert_params == 256 * swiglu * 2048
    assert moe.num_params == mla + 2 * hidden + hidden * 256 + swiglu * 2048 + moe.expert_params
    assert moe.active_expert_params == moe.expert_params * 8 // 256
    assert moe.expert_fwd_flops == 2 * seq * 8 * swiglu * 2048  # a multiply-add is 2 FLOPs
