"""torchtitan's published runs (`benchmarks/published_torchtitan_runs.py`): their transcription,
and the layer-SAC rows priced by the rule `estimate --from` reads a torchtitan config with."""
from dataclasses import replace

import pytest

from meshplan.planner.costing.hardware import load_cluster


def _named(data, fragment):
    return [run for run in data.all_runs() if fragment in run.name]


def test_selective_op_tables_are_transcribed_with_compilation_and_precision(modules):
    data, _ = modules
    h100 = _named(data, "torchtitan H100 Llama3.1 8B") + _named(data, "Trainy H200")
    sac = [run for run in h100 if "selective op" in run.name]
    # torchtitan's Tables 1 and 3 (TPS per GPU) and Trainy's two rows, every one at local batch 2, 8K tokens
    published = {run.name: run.published_tokens_per_s / run.gpus for run in sac}
    assert sorted(published.values()) == [5605.0, 5762.0, 6514.0, 6667.0, 8380.0, 8532.0, 10753.0, 10938.0]
    for run in sac:
        assert (run.mbs, run.seq, run.global_batch, run.zero, run.recompute) == (2, 8192, 2 * run.gpus, 3, "selective")
        assert run.torch_compile == ("compile" in run.name)
        assert (run.group == data.HELD_OUT_FP8) == (run.precision == "fp8") == ("fp8" in run.name)
    table_2 = [run for run in h100 if " cp" in run.name]
    assert table_2 and all(run.torch_compile for run in table_2)  # Table 2 ran torch.compile + Float8


def test_layer_sac_rows_recompute_every_second_block(modules):
    data, fit = modules
    layer = _named(data, "selective layer")
    assert [run.published_tokens_per_s / run.gpus for run in layer] == [2904.0, 1914.0]
    run = layer[0]
    cluster = load_cluster(run.cluster)
    every = fit.predict(run, cluster, vpp=1)
    full = fit.predict(replace(run, recompute_every=1), cluster, vpp=1)
    none = fit.predict(replace(run, recompute="none", recompute_every=1), cluster, vpp=1)
    # identical blocks: half of them rerun whole, so half of full recomputation's rerun time
    assert every.breakdown["recompute"] == pytest.approx(0.5 * full.breakdown["recompute"], rel=1e-9)
    assert none.step_time_s < every.step_time_s < full.step_time_s


def test_a_layer_sac_run_needs_full_recomputation_without_a_pipeline(modules):
    data, _ = modules
    run = _named(data, "selective layer")[0]
    with pytest.raises(ValueError, match="recompute_every 2 needs recompute 'full'"):
        replace(run, recompute="selective")
    with pytest.raises(ValueError, match="at pp 2"):
        replace(run, pp=2)


def test_async_tp_tables_are_transcribed_row_by_row(modules):
    data, _ = modules
    rows = [run for run in data.all_runs() if run.source == data.TORCHTITAN_ASYNC_TP]
    published = {(run.spec, run.fp8_recipe, run.tp_comm_overlap): run.published_tokens_per_s / run.gpus for run in rows}
    assert published == {
        ("llama3-70b", None, False): 597.3, ("llama3-70b", None, True): 652.4,
        ("llama3-70b", "tensorwise", False): 809.8, ("llama3-70b", "tensorwise", True): 942.4,
        ("llama3-70b", "rowwise", False): 599.6, ("llama3-70b", "rowwise", True): 624.8,
        ("llama3-8b", None, False): 4378.0, ("llama3-8b", None, True): 4809.4,
        ("llama3-8b", "tensorwise", False): 5078.1, ("llama3-8b", "tensorwise", True): 5570.1,
        ("llama3-8b", "rowwise", False): 3708.5, ("llama3-8b", "rowwise", True): 3914.9}
    for run in rows:  # FSDP x TP 8 over every GPU, each table's local batch, AC and compilation
        seventy = run.spec == "llama3-70b"
        assert (run.gpus, run.mbs, run.recompute) == ((256, 16, "full") if seventy else (64, 12, "selective"))
        assert (run.tp, run.sp, run.zero, run.global_batch, run.torch_compile) == (8, True, 3, run.mbs * run.gpus // 8, True)
        assert (run.group == data.HELD_OUT_FP8) == (run.fp8_recipe is not None)


def test_torchaos_float8_benchmarks_are_transcribed_row_by_row(modules):
    """torchao's H100 table: Llama3-8b on 8 H100, FSDP2 over the 8, local batch 1, 8,192 tokens,
    compiled, per-op SAC; BF16, tensorwise (float8 all-gather) and rowwise (bf16 all-gather)."""
    data, _ = modules
    rows = [run for run in data.all_runs() if run.source == data.TORCHAO_FLOAT8]
    published = {run.fp8_recipe: run.published_tokens_per_s / run.gpus for run in rows}
    assert published == {None: 6150.0, "tensorwise": 7689.5, "rowwise": 6768.0}
    for run in rows:
        assert (run.spec, run.gpus, run.global_batch, run.mbs, run.seq) == ("llama3-8b", 8, 8, 1, 8192)
        assert (run.tp, run.zero, run.recompute, run.torch_compile, run.engine) == (1, 3, "selective", True, "torchtitan")
        assert (run.group == data.HELD_OUT_FP8) == (run.precision == "fp8") == (run.fp8_recipe is not None)
