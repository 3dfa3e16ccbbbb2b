"""The closed-form layer graph against the traced one: equal field by field, not close.

Every case traces the zoo model on the meta device (small shapes; presets collapse to one block)
and compares each LayerProfile field, the ModelInfo and the layer names and repeats with
`planner.profiling.analytic`. A change to the zoo's code that changes what it computes or saves
fails here until the closed form follows.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.models.registry import parse_spec
from meshplan.planner.profiling.analytic import analytic_graph
from meshplan.planner.profiling.profiler import profile

GPT = "gpt:layers=2,hidden=64,heads=4,vocab=1000"  # vocab 1000: padded to 1024 (tp 1, 2, 4 and 8)
GPT_UNTIED = "gpt:layers=2,hidden=64,heads=2,vocab=777,tied=0,positions=40"
GPT_ONE_HEAD = "gpt:layers=2,hidden=64,heads=1,vocab=1000"  # the o Linear's input is a view, no copy
LLAMA_GQA = "llama:layers=2,hidden=128,heads=8,kv_heads=2,ffn=200,vocab=1001"
LLAMA_MQA = "llama:layers=2,hidden=128,heads=8,kv_heads=1,ffn=352,vocab=3000,rope_theta=500000"
LLAMA_TIED = "llama:layers=3,hidden=128,heads=4,ffn=200,vocab=1001,tied=1"
LLAMA_ONE_HEAD = "llama:layers=2,hidden=64,heads=1,ffn=96,vocab=500"
# Qwen's attention on the dense block: a head width other than hidden / heads with q/k norms
# (Qwen3), and q/k/v biases (Qwen2)
LLAMA_QWEN3 = "llama:layers=2,hidden=128,heads=4,kv_heads=2,ffn=200,vocab=1001,head_dim=48,qk_norm=1,tied=1"
LLAMA_QWEN2 = "llama:layers=2,hidden=128,heads=4,kv_heads=2,ffn=200,vocab=1001,qkv_bias=1"

# (spec, seq, batch, dtype, attention, tp). Math attention keeps head_dim != seq: the tracer
# tells the s x s scores by their shape, which q, K^T and V share when head_dim == seq.
CASES = [
    (GPT, 32, 1, "bf16", "flash", 1),
    (GPT, 32, 1, "fp16", "math", 2),
    (GPT, 7, 3, "fp32", "flash", 4),
    (GPT_UNTIED, 24, 1, "fp32", "math", 4),
    (GPT_UNTIED, 40, 2, "bf16", "flash", 1),
    (GPT_ONE_HEAD, 16, 1, "fp16", "flash", 1),
    (GPT_ONE_HEAD, 16, 1, "bf16", "math", 2),
    (LLAMA_GQA, 24, 1, "bf16", "flash", 1),
    (LLAMA_GQA, 24, 4, "fp32", "math", 1),
    (LLAMA_GQA, 12, 1, "fp16", "flash", 2),
    (LLAMA_MQA, 20, 1, "bf16", "math", 4),
    (LLAMA_MQA, 20, 1, "fp32", "flash", 1),
    (LLAMA_TIED, 1, 1, "fp32", "flash", 1),  # one position: the o Linear's input is a view
    (LLAMA_TIED, 9, 1, "bf16", "math", 2),
    (LLAMA_ONE_HEAD, 8, 1, "bf16", "flash", 4),
    (LLAMA_ONE_HEAD, 8, 1, "fp16", "math", 1),
    (LLAMA_QWEN3, 16, 1, "bf16", "flash", 1),
    (LLAMA_QWEN3, 20, 1, "fp32", "math", 2),
    (LLAMA_QWEN2, 16, 2, "bf16", "flash", 2),
    (LLAMA_QWEN2, 12, 1, "fp16", "math", 1),
    ("gpt2", 48, 1, "bf16", "math", 1),
    ("llama3-8b", 32, 1, "bf16", "flash", 1),
    ("llama2-70b", 16, 1, "fp16", "math", 1),
]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))


def _traced(spec: str, seq: int, batch: int, dtype: str, attention: str, tp: int):
    """The traced graph: the profiler's own path at tp 1; at tp > 1, the whole model built with
    the vocabulary padded for tp, measured and assembled by the profiler's functions."""
    if tp == 1:
        return profile(spec, seq, batch=batch, dtype=dtype, attention=attention, cache=False, trace=True)
    from meshplan.planner.models.registry import build_model
    from meshplan.planner.profiling import profiler

    return assembled_trace(build_model(spec, seq, tp=tp, dtype=profiler.torch_dtype(dtype)), spec, seq, dtype,
                           attention)


def assembled_trace(built, spec: str, seq: int, dtype: str, attention: str):
    """A whole built model measured on the meta device and assembled by the profiler's functions
    (repeats marked by comparing the measured blocks)."""
    from meshplan.planner.contracts.graph import ModelGraph
    from meshplan.planner.profiling import profiler
    from meshplan.planner.profiling.tracing import measure_layers

    groups = built.layer_groups
    measurements, order = measure_layers(built, groups, attention)
    layers = profiler._mark_repeats(profiler._measured_profiles(built, groups, measurements, order),
                                    groups, measurements, order)
    return ModelGraph(spec=spec, seq=seq, dtype=dtype, attention=attention, layers=layers, info=built.info)


def differences(traced, analytic) -> list[str]:
    lines = [f"info: traced {traced.info} != analytic {analytic.info}"] if traced.info != analytic.info else []
    if [layer.name for layer in traced.layers] != [layer.name for layer in analytic.layers]:
        return lines + ["layer names differ"]
    for measured, derived in zip(traced.layers, analytic.layers):
        derived_fields = asdict(derived)
        lines += [f"{measured.name}.{name}: traced {value} != analytic {derived_fields[name]}"
                  for name, value in asdict(measured).items() if value != derived_fields[name]]
    return lines


@pytest.mark.parametrize("spec,seq,batch,dtype,attention,tp", CASES)
def test_analytic_graph_equals_traced_graph(spec, seq, batch, dtype, attention, tp):
    traced = _traced(spec, seq, batch, dtype, attention, tp)
    if tp == 1:
        analytic = profile(spec, seq, batch=batch, dtype=dtype, attention=attention)
    else:
        analytic = analytic_graph(spec, parse_spec(spec, seq), seq, dtype, attention, tp=tp)
    assert differences(traced, analytic) == []
    assert analytic == traced  # every field, the repeats and the TP splits included


def test_zoo_specs_are_not_traced(monkeypatch):
    """profile() answers zoo specs in closed form: the tracer is never reached."""
    from meshplan.planner.profiling import profiler

    def refuse(*args, **kwargs):
        raise AssertionError("traced a zoo spec")

    monkeypatch.setattr(profiler, "_profile_uncached", refuse)
    graph = profile("llama3-405b", 8192)
    assert graph.total_params == 405_853_388_800 and len(graph.layers) == 128
    assert graph.layers[-2].repeat_of == "blocks.0"


def test_gpt_sequence_beyond_learned_positions_is_refused_alike():
    with pytest.raises(MeshplanError) as analytic:
        profile("gpt2", 2048)
    with pytest.raises(MeshplanError) as traced:
        profile("gpt2", 2048, cache=False, trace=True)
    assert str(analytic.value) == str(traced.value)


@pytest.mark.parametrize("engine", ["meshplan", "torchtitan"])
def test_estimate_on_a_parametric_spec_imports_no_torch(tmp_path, engine):
    """The whole `meshplan estimate` command, in a fresh interpreter with an empty profile cache,
    under meshplan's executor and torchtitan (both of whose eager blocks are counted op by op, in
    closed form: `costing.eager_kernels`)."""
    argv = ["estimate", "--model", "llama3-70b", "--cluster", "h100-sxm", "--gpus", "64", "--gbs", "64",
            "--seq", "8192", "--tp", "8", "--pp", "2", "--sp", "--engine", engine, "--json"]
    script = ("import sys; from meshplan.cli import main; code = main(sys.argv[1:]); "
              "torch = sorted(name for name in sys.modules if name.split('.')[0] == 'torch'); "
              "print('torch modules:', torch[:5], file=sys.stderr); sys.exit(code or bool(torch))")
    env = {**os.environ, "MESHPLAN_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch modules: []" in done.stderr
    assert json.loads(done.stdout)["step_time_s"] > 0
