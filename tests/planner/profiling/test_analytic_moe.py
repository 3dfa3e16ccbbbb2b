"""The closed-form MoE layer graph against the traced one: equal field by field, not close.

Every case traces the zoo's `MoECausalLM` on the meta device (the profiler's own collapsed
build at tp 1; the whole model, with the vocabulary padded for tp, at tp 2 and 4) and compares
each LayerProfile field, the ModelInfo and the layer names and repeats with
`planner.profiling.analytic_moe`. A change to `models/moe.py` (or the zoo's attention and dense
block) that changes what it computes or saves fails here until the closed form follows.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.models.config import TransformerConfig
from meshplan.planner.models.registry import parse_spec
from tests.planner.profiling.test_analytic import assembled_trace, differences
from meshplan.planner.profiling.analytic_moe import moe_analytic_graph
from meshplan.planner.profiling.profiler import profile

# GQA, no shared experts, no dense block; vocab 1000 pads to 1024 for tp 1, 2 and 4.
MOE_GQA = "moe:layers=2,hidden=64,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=48,vocab=1000"
# Shared experts, one dense block first, q/k norms and a head width (24) that is not hidden / heads.
MOE_SHARED = ("moe:layers=3,hidden=64,heads=4,kv_heads=2,experts=8,top_k=2,expert_ffn=48,vocab=1000,"
              "shared_experts=2,dense_layers=1,ffn=96,qk_norm=1,head_dim=24")
# Two dense blocks (the MoE blocks repeat the collapsed model's `blocks.1`), MQA, no RoPE, q/k norms,
# more experts than routed copies at short sequences (experts with no tokens).
MOE_SPARSE = ("moe:layers=4,hidden=64,heads=4,kv_heads=1,experts=16,top_k=1,expert_ffn=40,vocab=1000,"
              "dense_layers=2,ffn=96,rope_theta=0,qk_norm=1")
# One expert taking every token, MHA, tied embeddings.
MOE_ONE_EXPERT = "moe:layers=2,hidden=32,heads=2,kv_heads=2,experts=1,top_k=1,expert_ffn=16,vocab=300,tied=1"
# One head (the o Linear's input is a view), 7 * 3 copies over 5 experts (uneven), no aux loss.
MOE_ONE_HEAD = "moe:layers=2,hidden=48,heads=1,kv_heads=1,experts=5,top_k=3,expert_ffn=20,vocab=777,aux_loss=0"
# q width 8 * 16 = 128 above hidden 64, a shared expert without dense blocks, top_k 4 of 6.
MOE_WIDE_Q = ("moe:layers=3,hidden=64,heads=8,kv_heads=4,experts=6,top_k=4,expert_ffn=32,vocab=1001,"
              "shared_experts=1,head_dim=16,rope_theta=500000,aux_loss=0.1")

# (spec, seq, dtype, attention, tp). Math attention keeps head_dim != seq: the tracer tells the
# s x s scores by their shape, which q, K^T and V share when head_dim == seq.
CASES = [
    (MOE_GQA, 16, "bf16", "flash", 1),
    (MOE_GQA, 20, "fp32", "math", 2),
    (MOE_GQA, 33, "fp16", "flash", 4),
    (MOE_SHARED, 12, "fp16", "flash", 1),
    (MOE_SHARED, 12, "bf16", "math", 1),
    (MOE_SHARED, 10, "fp32", "flash", 4),
    (MOE_SPARSE, 5, "fp32", "math", 1),
    (MOE_SPARSE, 5, "bf16", "flash", 1),
    (MOE_SPARSE, 24, "fp16", "math", 1),
    (MOE_ONE_EXPERT, 1, "fp32", "flash", 1),  # one position: the o Linear's input is a view
    (MOE_ONE_EXPERT, 9, "bf16", "math", 2),
    (MOE_ONE_EXPERT, 9, "fp16", "flash", 1),
    (MOE_ONE_HEAD, 7, "bf16", "flash", 4),
    (MOE_ONE_HEAD, 7, "fp16", "math", 1),
    (MOE_WIDE_Q, 20, "bf16", "math", 1),
    (MOE_WIDE_Q, 20, "fp32", "flash", 2),
    # The presets, at short sequences (the trace of one block is shapes only, but costs time per op).
    ("mixtral-8x7b", 64, "bf16", "math", 1),
    ("mixtral-8x22b", 32, "fp32", "flash", 1),
    ("qwen3-30b-a3b", 96, "fp16", "math", 1),
    ("qwen3-235b-a22b", 128, "bf16", "flash", 1),
]

# Options a `moe:` spec cannot set but a config can (Qwen2-MoE's through `hf:`): q/k/v biases, a
# shared expert width of its own and the shared experts' sigmoid gate.
QWEN2_STYLE = TransformerConfig("moe", 3, 64, 4, 1000, ffn=80, num_kv_heads=2, tied_embeddings=False,
                                qkv_bias=True, num_experts=6, top_k=2, expert_ffn=24, num_shared_experts=1,
                                shared_expert_ffn=72, shared_expert_gate=True, dense_layers=1)
CONFIG_CASES = [
    (QWEN2_STYLE, 16, "bf16", "flash", 1),
    (QWEN2_STYLE, 18, "fp32", "math", 2),
    (replace(QWEN2_STYLE, dense_layers=0, qk_norm=True, attn_head_dim=8), 11, "fp16", "flash", 1),
]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))


def _traced_whole(spec: str, cfg: TransformerConfig, seq: int, dtype: str, attention: str, tp: int):
    """The whole model built with the vocabulary padded for `tp`, measured and assembled."""
    from meshplan.planner.models import registry
    from meshplan.planner.profiling import profiler

    return assembled_trace(registry._build_zoo(spec, cfg, seq, tp, "meta", profiler.torch_dtype(dtype)),
                           spec, seq, dtype, attention)


def _assert_equal(traced, analytic) -> None:
    assert differences(traced, analytic) == []
    assert analytic == traced  # every field, the repeats and the TP splits included
    assert analytic.info.family == "moe" and any(layer.expert_params for layer in analytic.layers)


@pytest.mark.parametrize("spec,seq,dtype,attention,tp", CASES)
def test_moe_analytic_graph_equals_traced_graph(spec, seq, dtype, attention, tp):
    if tp == 1:  # the profiler's own paths: collapsed trace against its closed form
        traced = profile(spec, seq, dtype=dtype, attention=attention, cache=False, trace=True)
        analytic = profile(spec, seq, dtype=dtype, attention=attention)
    else:
        cfg = parse_spec(spec, seq)
        traced = _traced_whole(spec, cfg, seq, dtype, attention, tp)
        analytic = moe_analytic_graph(spec, cfg, seq, dtype, attention, tp=tp)
    _assert_equal(traced, analytic)


@pytest.mark.parametrize("cfg,seq,dtype,attention,tp", CONFIG_CASES)
def test_moe_analytic_graph_covers_config_only_options(cfg, seq, dtype, attention, tp):
    _assert_equal(_traced_whole("qwen2-style", cfg, seq, dtype, attention, tp),
                  moe_analytic_graph("qwen2-style", cfg, seq, dtype, attention, tp=tp))


def test_dense_rules_shared_with_moe_follow_rope_theta_zero():
    """The attention rules MoE blocks reuse from `analytic`: no RoPE tables when rope_theta is 0."""
    spec = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=500,rope_theta=0"
    for attention in ("flash", "math"):
        assert profile(spec, 12, attention=attention) == profile(spec, 12, attention=attention, cache=False,
                                                                 trace=True)


def test_moe_specs_are_not_traced(monkeypatch):
    """profile() answers MoE presets and moe: specs in closed form: the tracer is never reached."""
    from meshplan.planner.profiling import profiler

    def refuse(*args, **kwargs):
        raise AssertionError("traced a MoE zoo spec")

    monkeypatch.setattr(profiler, "_profile_uncached", refuse)
    graph = profile("qwen3-235b-a22b", 4096)
    assert len(graph.layers) == 96 and graph.layers[-2].repeat_of == "blocks.0"
    assert round(graph.total_params / 1e9, 1) == 235.1 and round(graph.active_params / 1e9, 1) == 22.2
    assert profile(MOE_SHARED, 64).layer("blocks.2").repeat_of == "blocks.1"


def test_hf_and_file_specs_have_no_closed_form():
    from meshplan.planner.profiling.profiler import _closed_form

    assert _closed_form("hf:/nowhere/config.json", 64, "bf16", "flash") is None
    assert _closed_form("/nowhere/model.py:build", 64, "bf16", "flash") is None


def test_routing_options_apply_alike_to_closed_form_and_trace():
    options = dict(moe_imbalance=1.4, moe_capacity_factor=1.25, moe_pad_to_capacity=True)
    analytic = profile(MOE_SHARED, 32, **options)
    assert analytic == profile(MOE_SHARED, 32, cache=False, trace=True, **options)
    assert (analytic.info.moe_imbalance, analytic.info.moe_capacity_factor, analytic.info.moe_pad_to_capacity) == \
        (1.4, 1.25, True)
    assert profile(MOE_SHARED, 32) == replace(analytic, info=replace(
        analytic.info, moe_imbalance=1.0, moe_capacity_factor=0.0, moe_pad_to_capacity=False))
    for bad in (dict(moe_imbalance=0.5), dict(moe_capacity_factor=-1.0), dict(moe_pad_to_capacity=True)):
        with pytest.raises(MeshplanError) as closed:
            profile(MOE_GQA, 16, **bad)
        with pytest.raises(MeshplanError) as traced:
            profile(MOE_GQA, 16, cache=False, trace=True, **bad)
        assert str(closed.value) == str(traced.value)


def test_profile_and_estimate_on_a_moe_spec_import_no_torch(tmp_path):
    """`meshplan profile` and `meshplan estimate` on a moe: spec, in a fresh interpreter with an
    empty profile cache."""
    spec = ("moe:layers=8,hidden=1024,heads=16,kv_heads=4,experts=16,top_k=2,expert_ffn=512,vocab=32000,"
            "shared_experts=1,dense_layers=1,ffn=2816,qk_norm=1,head_dim=64")
    script = ("import sys; from meshplan.cli import main; "
              f"code = main(['profile', '--model', {spec!r}, '--seq', '4096', '--json']); "
              "print('---', flush=True); "
              f"code = code or main(['estimate', '--model', {spec!r}, '--cluster', 'h100-sxm', '--gpus', '16', "
              "'--gbs', '64', '--seq', '4096', '--ep', '4', '--json']); "
              "torch = sorted(name for name in sys.modules if name.split('.')[0] == 'torch'); "
              "print('torch modules:', torch[:5], file=sys.stderr); sys.exit(code or bool(torch))")
    env = {**os.environ, "MESHPLAN_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch modules: []" in done.stderr
    profiled, estimated = done.stdout.split("---\n")
    assert json.loads(profiled)["active_params"] < json.loads(profiled)["total_params"]
    assert json.loads(estimated)["step_time_s"] > 0
    assert not (tmp_path / "cache").exists()  # nothing traced, nothing cached
