"""A Hugging Face model's embedding and output head under tensor parallelism: replicated on every
rank as meshplan's executor runs them, vocab-parallel under the engines that split every model's
vocabulary (Megatron-Core, torchtitan; `costing.tp_split.as_engine_splits`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.tp_split import as_engine_splits

pytest.importorskip("transformers")

LLAMA3_8B = f"hf:{Path(__file__).parents[1] / 'models' / 'hf_configs' / 'llama3_8b.json'}"
VOCAB = 128256  # Llama 3's vocabulary (the fixture's vocab_size)
SEQ = 256


@pytest.fixture(scope="module")
def graph():
    from meshplan.planner.profiling.profiler import profile

    return profile(LLAMA3_8B, SEQ)


def _layer(graph, kind: str):
    return next(layer for layer in graph.layers if layer.kind == kind)


def _config(engine: str, tp: int) -> ParallelConfig:
    """4 data ranks (ZeRO-1 shards the same share of each rank's states) of `tp` GPUs."""
    return ParallelConfig(gpus=4 * tp, global_batch=8, tp=tp, pp=1, dp=4, sp=tp > 1, zero=1, engine=engine)


def test_profile_keeps_the_executors_replicated_head(graph):
    assert graph.info.family == "hf" and graph.info.vocab == VOCAB
    for kind in ("embedding", "head"):
        assert _layer(graph, kind).tp_split.kind == "none"


@pytest.mark.parametrize("engine", ["megatron", "torchtitan"])
def test_vocab_parallel_engines_split_the_vocabulary_padded_as_megatron_pads_it(graph, engine):
    head = _layer(graph, "head")
    split = as_engine_splits(head, engine, 8, graph.info)
    # 128256 is not a multiple of 128 * 8 = 1024: padded to the next one, 126 * 1024
    assert split.tp_split.kind == "vocab" and split.tp_split.vocab_size == 126 * 1024
    assert as_engine_splits(head, engine, 8, graph.info) is split  # one object: the cost memos key on id
    assert as_engine_splits(head, engine, 2, graph.info).tp_split.vocab_size == VOCAB  # 501 * 256 exactly


@pytest.mark.parametrize("engine,tp", [("meshplan", 2), ("generic", 2), ("deepspeed", 2), ("megatron", 1)])
def test_other_engines_and_tp1_keep_the_layer(graph, engine, tp):
    head = _layer(graph, "head")
    assert as_engine_splits(head, engine, tp, graph.info) is head
    block = _layer(graph, "block")
    assert as_engine_splits(block, "megatron", 2, graph.info) is block


@pytest.mark.parametrize("kind", ["embedding", "head"])
def test_megatron_prices_half_the_vocabulary_per_rank_at_tp2(graph, kind):
    """At TP 2 the vocabulary (501 * 256 rows, no padding) halves exactly: each rank holds half the
    weight; meshplan's executor keeps the whole of it on both ranks."""
    layer, cluster = _layer(graph, kind), load_cluster("h100-sxm")
    whole = layer_cost(layer, _config("megatron", 1), cluster, graph.info, profile_dtype=graph.dtype)
    split = layer_cost(layer, _config("megatron", 2), cluster, graph.info, profile_dtype=graph.dtype)
    executor = layer_cost(layer, _config("meshplan", 2), cluster, graph.info, profile_dtype=graph.dtype)
    executor_whole = layer_cost(layer, _config("meshplan", 1), cluster, graph.info, profile_dtype=graph.dtype)
    assert split.param_bytes == pytest.approx(whole.param_bytes / 2, rel=1e-9)
    assert executor.param_bytes == pytest.approx(executor_whole.param_bytes, rel=1e-9)
    if kind == "head":  # the logits GEMM: half the columns a rank, a little over half the time
        assert 0.5 * whole.fwd_compute_s < split.fwd_compute_s < 0.75 * whole.fwd_compute_s
        assert executor.fwd_compute_s == pytest.approx(executor_whole.fwd_compute_s, rel=1e-9)


def test_profile_says_which_engines_split_the_vocabulary(run_cli):
    code, out, err = run_cli("profile", "--model", LLAMA3_8B, "--seq", SEQ)
    assert code == 0, err
    assert "tp split of the embedding and head: none as meshplan's executor runs them" in out
    assert "under --engine megatron and torchtitan they are split over the vocabulary" in out
    code, out, _ = run_cli("profile", "--model", "llama3-8b", "--seq", SEQ)  # a zoo model splits them anyway
    assert code == 0 and "tp split of the embedding and head" not in out
