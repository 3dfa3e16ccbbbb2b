"""Each engine's memory recipe (`costing.engine_memory`): Korthikanti et al.'s published activations
under Megatron-LM, the engines' model-state bytes, nothing of meshplan's executor charged to another
engine, the allocator's reserve, and the search planning under the engine asked for."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import engine_memory
from meshplan.planner.costing.engine_memory import (ALLOCATOR_FRAGMENTATION, ALLOCATOR_FRAGMENTATION_PLAIN,
                                                    engine_state_bytes, keeps_stage_outputs)
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.simulation.estimator import estimate

GIB = 2**30

# Korthikanti et al. 2022 (arXiv:2205.05198), Figure 1: first-stage activation memory with sequence
# parallelism and selective recomputation (GiB), on the shapes and degrees of its Table 3 (seq 2048,
# vocab 51200, TP 8). 175B and 530B run interleaved with 3 chunks per rank (the 1 + (p-1)/(pm)
# factor of its section 4.2.3 at m = 3 gives the published figures).
KORTHIKANTI_FIGURE_1 = [
    # name, layers, hidden, heads, pp, gpus, global batch, micro-batch, schedule, vpp, GiB
    ("22B", 48, 6144, 64, 1, 8, 4, 4, "1f1b", 1, 9.6),
    ("175B", 96, 12288, 96, 8, 64, 64, 1, "interleaved", 3, 12.4),
    ("530B", 105, 20480, 128, 35, 280, 280, 1, "interleaved", 3, 23.1),
    ("1T", 128, 25600, 160, 64, 512, 512, 1, "1f1b", 1, 26.6),
]


@pytest.mark.parametrize("row", KORTHIKANTI_FIGURE_1, ids=[row[0] for row in KORTHIKANTI_FIGURE_1])
def test_korthikanti_figure_1_first_stage_activations(row):
    name, layers, hidden, heads, pp, gpus, gbs, mbs, schedule, vpp, published_gib = row
    prediction = estimate(f"gpt:layers={layers},hidden={hidden},heads={heads},vocab=51200", "a100-80g", gpus=gpus,
                          global_batch=gbs, seq=2048, tp=8, pp=pp, mbs=mbs, sp=True, recompute="selective",
                          schedule=schedule, vpp=vpp, engine="megatron")
    assert prediction.memory[0].activations / GIB == pytest.approx(published_gib, rel=0.05)


def test_korthikanti_34sbh_per_layer():
    """One GPT-3 block under TP 8 with SP keeps 34 s b h / t bytes (+ the fp32 log-sum-exp of flash
    attention, 4 a s b / t); without SP the 10 s b h of the norms, their outputs and dropout masks
    stay whole (Korthikanti's equation 2: s b h (10 + 24/t))."""
    from meshplan.planner.costing.layer_cost import layer_cost
    from meshplan.planner.profiling.profiler import profile

    seq, hidden, heads, mbs, tp = 2048, 6144, 64, 4, 8
    graph = profile(f"gpt:layers=2,hidden={hidden},heads={heads},vocab=51200", seq)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    cluster = load_cluster("a100-80g")
    sbh = seq * mbs * hidden
    for sp, expected in ((True, sbh * 34 / tp), (False, sbh * (10 + 24 / tp))):
        config = ParallelConfig(gpus=tp, global_batch=mbs, tp=tp, microbatch_size=mbs, sp=sp, engine="megatron")
        cost = layer_cost(block, config, cluster, graph.info, profile_dtype=graph.dtype)
        assert cost.activation_bytes == pytest.approx(expected + 4 * heads * seq * mbs / tp)
        full = layer_cost(block, replace(config, recompute="full"), cluster, graph.info, profile_dtype=graph.dtype)
        assert full.activation_bytes == pytest.approx(2 * sbh / (tp if sp else 1))  # the layer's input


@pytest.mark.parametrize("engine, zero, pp, expected", [
    ("megatron", 0, 1, (2, 4, 12)),             # Megatron-LM dist_optimizer.md: 18 bytes
    ("megatron", 1, 1, (2, 4, 12 / 8)),         # distributed optimizer: 6 + 12/d
    ("megatron", 0, 1, (2, 4, 12)),
    ("torchtitan", 3, 1, (4 / 8, 4 / 8, 8 / 8)),          # FSDP2, fp32 sharded states
    ("torchtitan", 3, 2, (4 / 8 + 2, 4 / 8 + 4, 8 / 8)),  # PP: bf16 kept gathered, fp32 grads accumulated
    ("deepspeed", 2, 1, (2, 2 + 4 / 8, 12 / 8)),          # its estimator: 4 + 16/d
    ("deepspeed", 3, 1, (2 / 8, 4 / 8, 12 / 8)),          # 18/d
    ("deepspeed", 3, 2, (2, 2 + 4 / 8, 12 / 8)),          # the pipeline engine runs ZeRO-1 at most
])
def test_engine_state_bytes_per_parameter(engine, zero, pp, expected):
    states = engine_state_bytes(engine, 1.0, 8, zero, "bf16-mixed", pp)
    assert (states["params"], states["grads"], states["optimizer"]) == pytest.approx(expected)


def test_no_executor_extra_under_another_engine():
    """Plain data parallelism: meshplan's executor runs FSDP2's replicate (fp32 parameters and their
    bf16 copy, fp32 gradients); Megatron-LM keeps 2 + 4 + 12 bytes a parameter."""
    spec, cluster = "gpt:layers=4,hidden=512,heads=8,vocab=8192", "a100-80g"
    own = estimate(spec, cluster, gpus=2, global_batch=4, seq=256, mbs=2).memory[0]
    megatron = estimate(spec, cluster, gpus=2, global_batch=4, seq=256, mbs=2, engine="megatron").memory[0]
    params = megatron.params / 2
    assert megatron.grads == pytest.approx(4 * params) and megatron.optimizer == pytest.approx(12 * params)
    assert own.grads == pytest.approx(4 * params) and own.params == pytest.approx(6 * params)


def test_megatron_frees_the_pipeline_outputs():
    spec, cluster = "gpt:layers=8,hidden=512,heads=8,vocab=8192", "a100-80g"
    kwargs = dict(gpus=2, global_batch=8, seq=256, pp=2, mbs=1)
    megatron = estimate(spec, cluster, engine="megatron", **kwargs).memory[0]
    torchtitan = estimate(spec, cluster, engine="torchtitan", **kwargs).memory[0]
    assert not keeps_stage_outputs("megatron") and keeps_stage_outputs("torchtitan")
    # both keep the same blocks' 2 in-flight micro-batches; torchtitan also their stage outputs
    assert torchtitan.activations > megatron.activations


@pytest.mark.parametrize("recompute, fraction", [("none", ALLOCATOR_FRAGMENTATION_PLAIN),
                                                  ("full", ALLOCATOR_FRAGMENTATION)])
def test_the_allocator_reserve_is_the_engines_alone(monkeypatch, recompute, fraction):
    """Under another engine the buffers also hold the caching allocator's fragmentation around
    what the step allocates and frees: (activations + buffers) x f / (1 - f), with f GMLake's
    figure for the layers' pattern (15% where blocks recompute, 5% without); meshplan's own
    executor is planned against its profile's reserve alone."""
    spec = "gpt:layers=4,hidden=512,heads=8,vocab=8192"
    kwargs = dict(gpus=2, global_batch=8, seq=256, pp=1, recompute=recompute)
    reserved = estimate(spec, "a100-80g", engine="torchtitan", **kwargs).memory[0]
    own = estimate(spec, "a100-80g", **kwargs).memory[0]
    monkeypatch.setattr(engine_memory, "ALLOCATOR_FRAGMENTATION", 0.0)
    monkeypatch.setattr(engine_memory, "ALLOCATOR_FRAGMENTATION_PLAIN", 0.0)
    allocated = estimate(spec, "a100-80g", engine="torchtitan", **kwargs).memory[0]
    assert reserved.activations == allocated.activations
    transient = allocated.activations + allocated.buffers
    if recompute == "none":  # one pattern throughout: the formula exactly
        assert reserved.total - allocated.total == pytest.approx(transient * fraction / (1 - fraction))
    else:  # the blocks' bytes at 15%, the embedding's and head's (which never recompute) at 5%
        low, high = (transient * f / (1 - f) for f in (ALLOCATOR_FRAGMENTATION_PLAIN, fraction))
        assert low < reserved.total - allocated.total <= high
    assert own.total == estimate(spec, "a100-80g", **kwargs).memory[0].total  # meshplan: no such reserve
    # the breakdown names the reserve (of its buffers), and the JSON carries it only when held
    assert reserved.fragmented == pytest.approx(reserved.total - allocated.total)
    assert reserved.to_json()["fragmented"] == reserved.fragmented and "fragmented" not in own.to_json()


def test_the_reserve_follows_what_recomputation_rebuilds():
    """GMLake's figures at the ends (5% when nothing is rebuilt, 15% when a layer's whole
    activations are), in proportion between; and the reserved bytes of a
    layer, kept x (1 - d) / (1 - f(d)), fall as it rebuilds a larger share d."""
    from meshplan.planner.costing.engine_memory import allocator_reserve_fraction

    assert allocator_reserve_fraction("megatron", 0.0) == pytest.approx(0.05)
    assert allocator_reserve_fraction("megatron", 1.0) == pytest.approx(0.15)
    assert allocator_reserve_fraction("torchtitan", 0.4) == pytest.approx(0.09)
    assert allocator_reserve_fraction("meshplan", 1.0) == 0.0
    reserved = [(1 - d) / (1 - allocator_reserve_fraction("megatron", d)) for d in [i / 100 for i in range(101)]]
    assert all(b < a for a, b in zip(reserved, reserved[1:]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(engine=st.sampled_from(["megatron", "torchtitan", "deepspeed", "llm-foundry"]),
       spec=st.sampled_from(["gpt:layers=8,hidden=512,heads=8,vocab=8192",
                             "llama:layers=8,hidden=512,heads=8,kv_heads=4,ffn=1536,vocab=8192"]),
       tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), zero=st.sampled_from([1, 3]),
       attention=st.sampled_from(["flash", "math"]), seq=st.sampled_from([512, 2048]))
def test_no_engine_reserves_more_under_selective_recomputation(engine, spec, tp, pp, zero, attention, seq):
    """Under every engine's recipe, its allocator reserve included, the same plan with selective
    recomputation never predicts a higher peak on any rank than without recomputation."""
    if engine == "llm-foundry":
        pp = 1
    options = dict(seq=seq, tp=tp, pp=pp, mbs=1, zero=zero if pp == 1 else 1, sp=tp > 1, attention=attention,
                   engine=engine)
    none = estimate(spec, "a100-80g", 8, 16, recompute="none", **options)
    selective = estimate(spec, "a100-80g", 8, 16, recompute="selective", **options)
    for kept, rebuilt in zip(none.memory, selective.memory):
        assert rebuilt.total <= kept.total * (1 + 1e-12), (kept, rebuilt)


def test_the_search_plans_under_the_engine():
    from meshplan.planner.search.driver import search_plan

    spec = "gpt:layers=4,hidden=256,heads=4,vocab=4096"
    plans = {engine: search_plan(spec, "a100-80g", 2, 8, 256, engine=engine, top_k=1, time_limit_s=1.0)
             for engine in ("meshplan", "megatron")}
    assert plans["megatron"].config.engine == "megatron" and plans["meshplan"].config.engine == "meshplan"
    simulated = plans["megatron"].prediction["peak_memory_bytes"]
    again = estimate(spec, "a100-80g", gpus=2, global_batch=8, seq=256, engine="megatron",
                     tp=plans["megatron"].config.tp, pp=plans["megatron"].config.pp,
                     mbs=plans["megatron"].config.microbatch_size, zero=plans["megatron"].config.zero,
                     sp=plans["megatron"].config.sp)
    assert simulated == pytest.approx(again.peak_memory_bytes, rel=0.02)
    assert plans["megatron"].to_json()["engine"] == "megatron"


def test_megatrons_own_pipeline_cut():
    """Megatron-LM builds num_layers / (pp x vpp) blocks per chunk, the embedding first and the
    output layer last; where the blocks do not divide, the embedding and the loss count as layers;
    otherwise (and for other engines) meshplan's time-balanced cut stands in."""
    from meshplan.planner.costing.uniform import engine_layer_chunks

    kinds = ["embedding"] + ["block"] * 8 + ["head"]
    assert engine_layer_chunks(kinds, "megatron", 4) == (0, 0, 0, 1, 1, 2, 2, 3, 3, 3)
    six = ["embedding"] + ["block"] * 6 + ["head"]  # 6 blocks over 4 chunks: 8 layers, 2 each
    assert engine_layer_chunks(six, "megatron", 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert engine_layer_chunks(["embedding"] + ["block"] * 7 + ["head"], "megatron", 4) is None
    assert engine_layer_chunks(kinds, "torchtitan", 4) is None and engine_layer_chunks(kinds, "meshplan", 4) is None
    # estimate under the engine: a heavy output layer no longer piles blocks on the first stages
    spec = "llama:layers=8,hidden=512,heads=8,kv_heads=8,ffn=1536,vocab=128000"
    kwargs = dict(gpus=4, global_batch=16, seq=512, pp=4, schedule="interleaved", vpp=2)
    megatron = estimate(spec, "h100-sxm", engine="megatron", **kwargs)
    first = megatron.memory[0]
    assert first.params == pytest.approx(megatron.memory[1].params + 2 * 512 * 128000)  # + the embedding


def test_fp8_param_gather_keeps_fp8_weights_in_place_of_bf16():
    """Megatron under fp8 caches each Linear weight's fp8 row- and column-wise copies (2 bytes a
    parameter) beside its bf16 weight; with the distributed optimizer its fp8 all-gather
    (--fp8-param-gather, Megatron-Bridge's FP8 recipes) makes those copies the weights."""
    from meshplan.planner.costing import fp8

    spec = "llama:layers=4,hidden=512,heads=8,kv_heads=8,ffn=1536,vocab=8192"
    kwargs = dict(gpus=2, global_batch=4, seq=256, engine="megatron", precision="fp8", fp8_recipe="tensorwise")
    plain = estimate(spec, "h100-sxm", zero=0, **kwargs).memory[0]
    gathered = estimate(spec, "h100-sxm", zero=1, **kwargs).memory[0]
    bf16 = estimate(spec, "h100-sxm", zero=1, **{**kwargs, "precision": "bf16-mixed", "fp8_recipe": None}).memory[0]
    from meshplan.planner.profiling.profiler import profile

    blocks = sum(layer.num_params for layer in profile(spec, 256).layers if layer.kind == "block")
    assert plain.params == pytest.approx(bf16.params + 2 * blocks)
    assert gathered.params == pytest.approx(bf16.params)
    config = ParallelConfig(gpus=2, global_batch=4, dp=2, zero=1, precision="fp8", fp8_recipe="tensorwise",
                            engine="megatron")
    assert fp8.fp8_primary_weights(config) and not fp8.fp8_primary_weights(replace(config, zero=0))
    assert not fp8.fp8_primary_weights(replace(config, engine="torchtitan"))
