"""Hugging Face configs priced as the engines build them (`models.hf_engine`): under megatron and
torchtitan a Llama-style config is the zoo's `llama` model with exactly its shapes; under
meshplan's executor it is traced through transformers' modules."""
from __future__ import annotations

import json

import pytest

from meshplan.planner.models.hf_engine import engine_config
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.simulation.estimator import estimate

pytest.importorskip("transformers")

SMALL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6,
             hidden_act="silu")
# model_type -> what its config adds (Qwen3's head_dim differs from hidden / heads, as the 0.6B's does)
TYPES = {"llama": dict(attention_bias=False, mlp_bias=False, tie_word_embeddings=False, rope_theta=500000.0),
         "mistral": dict(sliding_window=None, tie_word_embeddings=False),
         "qwen2": dict(use_sliding_window=False, tie_word_embeddings=True),
         "qwen3": dict(head_dim=64, attention_bias=False, use_sliding_window=False, tie_word_embeddings=True)}


def config_spec(tmp_path, model_type: str, **overrides) -> str:
    data = {"model_type": model_type, **SMALL, **TYPES[model_type], **overrides}
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(data))
    return f"hf:{path}"


@pytest.mark.parametrize("model_type", sorted(TYPES))
def test_engine_graph_has_the_traced_models_parameters_and_flops(tmp_path, model_type):
    """Exact: the `llama` model megatron builds has transformers' parameters, block by block, and
    the same matmul and attention FLOPs (the vocabulary, 512, needs no padding)."""
    spec = config_spec(tmp_path, model_type)
    traced = profile(spec, 256, cache=False)
    own = profile(spec, 256, engine="megatron")
    assert traced.info.family == "hf" and own.info.family == "llama"
    assert own.total_params == traced.total_params
    for ours, theirs in zip(own.layers, traced.layers, strict=True):
        assert (ours.name, ours.num_params) == (theirs.name, theirs.num_params)
        if ours.kind == "block":
            assert (ours.fwd_flops, ours.bwd_flops, ours.attn_fwd_flops) == \
                (theirs.fwd_flops, theirs.bwd_flops, theirs.attn_fwd_flops)
    assert any("megatron builds it" in note for note in own.info.notes)


def test_an_hf_llama_under_an_engine_prices_as_its_llama_spec(tmp_path):
    """The same step time and memory, exactly, as the `llama:` spec of the same shapes under the
    engine; under meshplan's executor the traced transformers modules keep more (their fp32 norm
    copies, unfused RoPE and SwiGLU)."""
    spec = config_spec(tmp_path, "llama")
    zoo = "llama:layers=3,hidden=128,heads=4,kv_heads=2,ffn=352,vocab=512,rope_theta=500000"
    job = dict(gpus=2, global_batch=8, seq=1024, mbs=2, tp=2, sp=True)
    for engine in ("megatron", "torchtitan"):
        ours, theirs = estimate(spec, "h100-sxm", engine=engine, **job), estimate(zoo, "h100-sxm", engine=engine, **job)
        assert ours.step_time_s == theirs.step_time_s and ours.peak_memory_bytes == theirs.peak_memory_bytes
    traced = estimate(spec, "h100-sxm", engine="meshplan", **job)
    assert traced.memory[0].activations > estimate(zoo, "h100-sxm", engine="meshplan", **job).memory[0].activations


@pytest.mark.parametrize("model_type, engine, overrides", [
    ("llama", "megatron", dict(attention_bias=True)),        # a bias on o too: not the llama family's block
    ("llama", "megatron", dict(mlp_bias=True)),
    ("llama", "megatron", dict(hidden_act="gelu")),
    ("mistral", "megatron", dict(sliding_window=64)),
    ("qwen3", "megatron", dict(use_sliding_window=True)),
    ("qwen2", "torchtitan", {}),                              # torchtitan has no Qwen2 model of its own
    ("llama", "torchtitan", dict(tie_word_embeddings=True)),  # its Llama 3 flavours are untied
    ("llama", "deepspeed", {}),                               # DeepSpeed trains the modules as written
    ("llama", "meshplan", {}),
])
def test_configs_an_engine_does_not_build_as_llama_stay_traced(tmp_path, model_type, engine, overrides):
    spec = config_spec(tmp_path, model_type, **overrides)
    assert engine_config(spec[3:], engine) is None
    assert profile(spec, 128, engine=engine).info.family == "hf"


def test_plans_under_an_engine_carry_and_reread_the_engine_graph(tmp_path):
    """A plan searched under megatron is simulated again from the same (closed-form) graph."""
    from meshplan import plan
    from meshplan.planner.simulation.simulator import simulate

    spec = config_spec(tmp_path, "qwen3")
    result = plan(spec, "h100-sxm", 2, 8, 512, engine="megatron")
    assert result.graph is not None and result.graph.info.family == "llama"
    assert result.graph.spec == spec
    step = simulate(result).step_time_s
    assert step == pytest.approx(result.prediction["step_time_s"], rel=1e-9)


@pytest.mark.parametrize("model_type, spec_keys", [
    ("qwen3", "layers=3,hidden=128,heads=4,kv_heads=2,ffn=352,vocab=512,tied=1,head_dim=64,qk_norm=1"),
    ("qwen2", "layers=3,hidden=128,heads=4,kv_heads=2,ffn=352,vocab=512,tied=1,qkv_bias=1"),
])
def test_qwen_configs_price_as_their_llama_spec(tmp_path, model_type, spec_keys):
    """The llama: spec names Qwen's attention (head_dim, qk_norm, qkv_bias): the same estimate."""
    spec = config_spec(tmp_path, model_type)
    job = dict(gpus=2, global_batch=8, seq=1024, mbs=2, tp=2, sp=True, engine="megatron")
    ours, theirs = estimate(spec, "h100-sxm", **job), estimate(f"llama:{spec_keys}", "h100-sxm", **job)
    assert ours.step_time_s == theirs.step_time_s and ours.peak_memory_bytes == theirs.peak_memory_bytes


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_megatron_export_writes_the_configs_model_and_reads_back_its_shape(tmp_path, model_type):
    """`export --to megatron` of an hf: plan writes the model Megatron-Bridge builds (head width,
    q/k norms, q/k/v biases, the norms' epsilon), and reading those arguments without meshplan's
    header gives a spec of exactly the config's parameters."""
    from meshplan import plan
    from meshplan.planner.engines.megatron import export_megatron, read_megatron

    spec = config_spec(tmp_path, model_type)
    text, notes = export_megatron(plan(spec, "h100-sxm", 2, 8, 512, engine="megatron"))
    assert not [note for note in notes if "by hand" in note]
    flags = set(text.split())
    assert ("--qk-layernorm" in flags, "--add-qkv-bias" in flags) == (model_type == "qwen3", model_type == "qwen2")
    assert ("--kv-channels" in flags) == (model_type == "qwen3")  # 64 against hidden / heads = 32
    assert "--norm-epsilon" in flags  # 1e-6 against Megatron-LM's 1e-5
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    read = read_megatron(body).model
    assert read.startswith("llama:")
    assert profile(read, 256).total_params == profile(spec, 256, cache=False).total_params


def test_megatron_export_of_an_hf_mixtral_reads_back_as_the_preset():
    """An hf: MoE config the moe family builds (`hf.hf_moe_config`) is written as that model too."""
    from pathlib import Path

    from meshplan import plan
    from meshplan.planner.engines.megatron import export_megatron, read_megatron

    spec = f"hf:{Path(__file__).parent / 'hf_configs' / 'mixtral_8x7b.json'}"
    text, notes = export_megatron(plan(spec, "h100-sxm", 64, 256, 4096, engine="megatron"))
    assert notes == []
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    assert read_megatron(body).model == "mixtral-8x7b"


def test_an_hf_llama3_config_exports_as_torchtitans_llama3_flavour():
    """Llama 3 8B's own config.json is torchtitan's llama3 '8B' flavour; a Mixtral config, which
    torchtitan does not build as its Llama 3, is none."""
    from pathlib import Path

    from meshplan.planner.engines.shapes import torchtitan_flavour

    fixtures = Path(__file__).parent / "hf_configs"
    assert torchtitan_flavour(f"hf:{fixtures / 'llama3_8b.json'}") == ("llama3", "8B")
    assert torchtitan_flavour(f"hf:{fixtures / 'mixtral_8x7b.json'}") is None


def test_a_traced_mixture_of_experts_under_torchtitan_says_whose_memory_it_is():
    """DeepSeek-V2-Lite stays traced (latent attention): under torchtitan the note says its memory is
    transformers' modules'; a Mixtral config (the moe family's) and other engines get no such note."""
    from pathlib import Path

    from meshplan.commands.common import model_notes

    notes = model_notes("deepseek-v2-lite", 4096, engine="torchtitan")
    assert any("torchtitan trains its own mixture-of-experts modules" in note for note in notes)
    assert not any("torchtitan trains" in note for note in model_notes("deepseek-v2-lite", 4096, engine="megatron"))
    mixtral = f"hf:{Path(__file__).parent / 'hf_configs' / 'mixtral_8x7b.json'}"
    assert not any("torchtitan trains" in note for note in model_notes(mixtral, 4096, engine="torchtitan"))
