"""The published runs behind the accuracy figures, and the efficiency fit, without the benchmark.

`benchmarks/published_runs.py` keeps the fit sets (the only runs that may tune a profile) apart
from the held-out runs; `benchmarks/fit_efficiency.py` fits the profiles on them. These tests
check the data's bookkeeping and that the fit's objective and solver recover an efficiency that
a synthetic case was generated with; the full fit and `bench_fidelity.py` are benchmarks.
"""
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshplan.planner.costing.hardware import builtin_profiles, load_cluster
from tests.benchmark_modules import benchmark_module



def configuration(run):
    return (run.spec, run.cluster, run.gpus, run.global_batch, run.seq, run.tp, run.pp, run.mbs, run.zero,
            run.recompute, run.sp, run.vpp_options, run.cp, run.ep)


def test_fit_sets_and_held_out_are_disjoint(modules):
    data, _ = modules
    fit = data.fit_runs("a100") + data.fit_runs("h100")  # 10 Narayanan + 2 Llama 3 + 9 Megatron-LM README
    held = data.held_out_runs()
    assert len(fit) == 21 and len(held) > 100
    assert not {r.name for r in fit} & {r.name for r in held}
    assert not {configuration(r) for r in fit} & {configuration(r) for r in held}
    assert not {r.source for r in fit} & {r.source for r in held}  # no source is split between them
    assert len({r.name for r in fit + held}) == len(fit + held)  # names identify runs


def test_every_run_has_a_source_a_profile_and_one_published_figure(modules):
    data, _ = modules
    profiles = set(builtin_profiles())
    for run in data.all_runs():
        assert run.source and run.assumptions, run.name
        assert run.cluster in profiles, run.name
        figures = [run.published_step_s, run.published_tokens_per_s, run.published_model_tflops_per_gpu,
                   run.published_causal_tflops_per_gpu]
        assert sum(f > 0 for f in figures) == 1, run.name
    for fabric in data.FABRIC_RUNS:
        assert fabric.source and fabric.cluster in profiles and fabric.busbw_gb_s > 0


def test_a_run_without_source_or_with_two_figures_is_refused(modules):
    data, _ = modules
    kwargs = dict(name="x", group=data.HELD_OUT, source="somewhere", cluster="a100-80g", spec="gpt2", gpus=8,
                  global_batch=8, seq=1024, published_step_s=1.0)
    data.Run(**kwargs)
    with pytest.raises(ValueError, match="source"):
        data.Run(**{**kwargs, "source": ""})
    with pytest.raises(ValueError, match="exactly one"):
        data.Run(**kwargs, published_tokens_per_s=5.0)
    with pytest.raises(ValueError, match="group"):
        data.Run(**{**kwargs, "group": "mpt"})


def test_moe_runs_are_held_out_apart_with_sources_and_valid_layouts(modules):
    """The MoE rows load, cite a repository and commit, are never in a fit set or the dense
    held-out set, and their layouts build (ep divides dp * cp and the expert count)."""
    data, fit = modules
    moe = [run for run in data.all_runs() if run.group == data.HELD_OUT_MOE]
    assert len(moe) >= 3
    assert not {r.name for r in moe} & {r.name for r in data.held_out_runs() + data.fit_runs("a100")
                                         + data.fit_runs("h100")}
    for run in moe:
        assert "github.com/" in run.source and "commit " in run.source, run.name
        assert run.assumptions and run.ep > 1 and run.cluster in ("h100-sxm", "gb200-nvl72", "b200"), run.name
        graph = fit.graph_of(run.spec, run.seq, run.attention)
        assert graph.info.is_moe and graph.info.num_experts % run.ep == 0, run.name
        assert fit.predict(run, load_cluster(run.cluster), run.vpp_options[0]).step_time_s > 0, run.name
    assert {r.precision for r in moe} == {"bf16-mixed", "fp8"}
    # the fit never reads them: fit_runs knows only the fit sets
    with pytest.raises(ValueError, match="unknown fit set"):
        data.fit_runs(data.HELD_OUT_MOE)


def test_qwen3_235b_rows_take_their_recipes_pipeline_split(modules):
    """Megatron-MoE-ModelZoo's Qwen3-235B config and Megatron-Bridge's recipe count the embedding and
    the loss as a layer each in the pipeline split: 96 "layers" over the chunks, the first and last
    chunks one block short.
    Every ModelZoo H100 row with a pipeline runs that split, blocking TP communication and
    Transformer Engine's loss, as its scripts set."""
    data, _ = modules
    moe = benchmark_module("published_moe_runs")
    assert moe.qwen3_235b_stage_blocks(32) == (2,) + (3,) * 30 + (2,)
    assert moe.qwen3_235b_stage_blocks(96) == (0,) + (1,) * 94 + (0,)
    assert moe.qwen3_235b_stage_blocks(8) == (11,) + (12,) * 6 + (11,)
    with pytest.raises(ValueError, match="94 blocks, the embedding and the loss do not split evenly over 7 chunks"):
        moe.qwen3_235b_stage_blocks(7)
    zoo = [run for run in data.all_runs() if run.source in (data.MEGATRON_MOE_QWEN3, data.MEGATRON_MOE_QWEN3_GB200)
           and run.spec == "qwen3-235b-a22b"]  # the table's Qwen3-Next row: its own config, no such split
    assert len(zoo) == 10
    for run in zoo:
        assert run.cross_entropy_fusion == "te", run.name
        assert run.tp == 1 or run.tp_comm_overlap is False, run.name
        if run.pp > 1:
            chunks = run.pp * run.vpp_options[0]
            assert run.stage_blocks == moe.qwen3_235b_stage_blocks(chunks) and sum(run.stage_blocks) == 94, run.name
    # Megatron-Bridge's Qwen3-235B recipe sets the same split
    bridge = [run for run in data.all_runs() if run.spec == "qwen3-235b-a22b" and run.name.startswith("Megatron-Bridge")]
    assert len(bridge) == 4
    for run in bridge:
        assert run.stage_blocks == moe.qwen3_235b_stage_blocks(run.pp * run.vpp_options[0]), run.name


def test_causal_flop_convention_matches_the_modelzoo_table(modules):
    """The ModelZoo's Qwen3 table prints step time and TFLOP/s per GPU together on its 4096-token
    rows (19.7 s / 245, 17.6 / 276, 24.2 / 200, 29.0 / 167 on 256 GPUs, GBS 2048): the FLOPs they
    imply per token agree with meshplan's causal count of the model (`causal_model_flops`) to the
    TFLOP/s rounding (1%), and not with the full-attention count; the long-context rows' step times
    come from that convention."""
    data, fit = modules
    graph = fit.graph_of("qwen3-235b-a22b", 4096, "cudnn")
    causal, full = fit.causal_model_flops(graph) / 4096, float(graph.fwd_flops + graph.bwd_flops) / 4096
    for step_s, tflops in ((19.7, 245), (17.6, 276), (24.2, 200), (29.0, 167)):
        implied = tflops * 1e12 * 256 * step_s / (2048 * 4096)
        assert implied == pytest.approx(causal, rel=0.01) and abs(implied / full - 1) > 0.1
    causal = [run for run in data.all_runs() if run.published_causal_tflops_per_gpu]
    # the long-context table, GB200's row and the best-practice scripts' three (published_zoo_script_runs)
    assert len(causal) == 8 and sum(run.seq > 4096 for run in causal) == 4
    for run in causal:
        step_s = fit.published_step_s(run)
        flops = fit.causal_model_flops(fit.graph_of(run.spec, run.seq, run.attention)) * run.global_batch
        assert step_s * run.gpus * run.published_causal_tflops_per_gpu * 1e12 == pytest.approx(flops)


def test_causal_flops_of_mixtral_8x22b_are_megatron_lms():
    """The ModelZoo's Mixtral 8x22B figures are TFLOP/s in Megatron-LM's convention; its
    `num_floating_point_operations` (megatron/training/training.py) for a GQA, SwiGLU, top-k MoE
    model, written out per token: 6 h (3 expert_ffn k) L for the experts, 6 (h (q + 2 kv) + q h) L
    for the projections, 6 h V for the logits and 6 q L s for causal attention's two products. It
    counts no router; meshplan's causal count (`causal_model_flops`) does, 6 h x experts per token
    and layer, 7e-5 of the total: they agree to 1e-4."""
    fit, scripts = benchmark_module("fit_efficiency"), benchmark_module("published_zoo_script_runs")
    seq = 4096
    graph = fit.graph_of(scripts.MIXTRAL_8X22B, seq, "cudnn")
    h, layers, vocab, expert_ffn, top_k, q, kv = 6144, 56, 32000, 16384, 2, 6144, 1024
    megatron = (6 * h * (3 * expert_ffn * top_k) * layers + 6 * (h * (q + 2 * kv) + q * h) * layers + 6 * h * vocab
                + 6 * q * layers * seq)
    assert fit.causal_model_flops(graph) / seq == pytest.approx(megatron, rel=1e-4)


def test_bridge_2026_qwen3_row_transcription_is_consistent(modules):
    """Megatron-Bridge's 26.06 DGX-H100 Qwen3-30B-A3B row prints 8826 tokens/s and 203 TFLOP/s per
    GPU: the FLOPs per token they imply (23.0 G) agree with meshplan's causal count of the model to
    the TFLOP/s rounding (0.5%), and the run carries the tokens/s as printed."""
    data, fit = modules
    run = next(r for r in data.all_runs() if r.name == "Megatron-Bridge 26.06 Qwen3-30B-A3B fp8 ep16")
    assert run.published_tokens_per_s == 8826.0 * run.gpus and run.gpus == 16 and run.ep == 16
    causal = fit.causal_model_flops(fit.graph_of(run.spec, run.seq, run.attention)) / run.seq
    assert 203e12 / 8826.0 == pytest.approx(causal, rel=0.005)


def test_dgx_cloud_deepseek_v3_rows_transcription_is_consistent(modules):
    """DGX Cloud's DeepSeek-V3 table prints step time, tokens/s and TFLOP/s per GPU (48.948 s,
    342,755.90, 174.02 on 512 H100; 52.04 s, 644,781.55, 163.7 on 1,024): the tokens/s are the
    recipe's 8 sequences of 4,096 per GPU over the step, and the FLOPs per token they imply
    (260.0 G) are meshplan's causal count of the model with the recipe's multi-token-prediction
    layer (`profiling.mtp`: one more MoE block, its 2h -> h projection, a second output-layer
    pass), to 1%."""
    data, fit = modules
    runs = [r for r in data.all_runs() if r.name.startswith("DGX Cloud DeepSeek-V3")]
    assert [(r.gpus, r.pp, r.published_step_s) for r in runs] == [(512, 8, 48.948), (1024, 16, 52.04)]
    graph = fit.graph_of("deepseek-v3", 4096, "cudnn", mtp_num_layers=1)  # as the rows are priced
    per_token = fit.causal_model_flops(graph) / 4096
    for run, (tokens_per_s, tflops) in zip(runs, ((342755.90, 174.02), (644781.55, 163.7))):
        assert run.global_batch == 8 * run.gpus and sum(run.stage_blocks) == 61 and len(run.stage_blocks) == run.pp
        assert run.mtp_num_layers == 1 and not run.tp_comm_overlap and run.cross_entropy_fusion == "te"
        assert run.global_batch * run.seq / run.published_step_s == pytest.approx(tokens_per_s, rel=1e-6)
        assert tflops * 1e12 * run.gpus / tokens_per_s == pytest.approx(per_token, rel=0.01)


def test_dgx_cloud_grok1_rows_transcription_is_consistent(modules):
    """DGX Cloud's Grok-1 H100 tables print step time and tokens/s (15.933 s, 526,493 in BF16; 13.433 s,
    624,478 in FP8): GBS 1,024 of 8,192 tokens over the step gives them (0.1%: the printed digits).
    The README's model FLOPs per sample (4.27E+15) are meshplan's causal count of the `moe:` spec
    the rows are priced on (1%), which pins its shape (64 blocks, hidden 6,144, 8 experts of FFN
    32,768, top 2, the 128,256-token vocabulary); its BF16 MFU (54.2% of 989 TFLOP/s) follows.
    launch.sh's layout fills the 512 GPUs (TP 4 x PP 8 x CP 2 x DP 8; EP 8 inside each stage's 64
    ranks), one block a virtual chunk, and the rows carry the script's switches."""
    data, fit = modules
    runs = [r for r in data.all_runs() if r.name.startswith("DGX Cloud Grok-1")]
    assert [(r.precision, r.published_step_s) for r in runs] == [("bf16-mixed", 15.933), ("fp8", 13.433)]
    per_sample = fit.causal_model_flops(fit.graph_of(runs[0].spec, 8192, "cudnn"))
    assert per_sample == pytest.approx(4.27e15, rel=0.01)
    assert 1024 * per_sample / 15.933 / 512 / 989e12 == pytest.approx(0.542, abs=0.002)
    for run, tokens_per_s in zip(runs, (526493, 624478)):
        assert run.group == data.HELD_OUT_MOE and run.engine == "megatron"
        assert run.global_batch * run.seq / run.published_step_s == pytest.approx(tokens_per_s, rel=1e-3)
        dp = run.gpus // (run.tp * run.pp * run.cp)
        assert (run.tp, run.pp, run.cp, dp, run.ep, run.etp, run.vpp_options) == (4, 8, 2, 8, 8, 1, (8,))
        assert run.global_batch // (dp * run.mbs) == 128  # the README's GA
        assert run.stage_blocks == (1,) * 64 and run.moe_capacity_factor == 1.0 and run.moe_pad_to_capacity
        assert run.tp_comm_overlap and run.grad_reduce_in_bf16 and run.cross_entropy_fusion == "te"
    assert runs[1].fp8_recipe == "delayed" and runs[0].fp8_recipe is None


def test_moe_fp8_and_bf16_runs_of_one_layout_pair_as_the_dense_ones_do(modules):
    """The FP8/BF16 target counts every published pair of one layout, MoE sources' too: among the
    held-out MoE runs, DGX Cloud's Grok-1 BF16 and FP8 rows pair on H100 (512 GPUs) and on GB200
    (128, 256 and 512 GPUs, each with its own GPU count only: one source, model, sequence, GPU
    count, profile and layout), and the dense pairing finds none of them."""
    data, _ = modules
    bench = benchmark_module("bench_fidelity")
    moe = [r for r in data.all_runs() if r.group == data.HELD_OUT_MOE]
    pairs = bench.fp8_pairs([r for r in moe if r.precision == "fp8"], [r for r in moe if r.precision != "fp8"])
    gb200 = [tuple(f"DGX Cloud GB200 Grok-1 314B {precision} tp4 etp4 ep8 x{gpus}" for precision in ("fp8", "bf16"))
             for gpus in (128, 256, 512)]
    assert [(f.name, b.name) for f, b in pairs] == [("DGX Cloud Grok-1 314B fp8 tp4 pp8 vpp8 cp2 ep8",
                                                     "DGX Cloud Grok-1 314B bf16 tp4 pp8 vpp8 cp2 ep8")] + gb200
    assert all(bench.layout_of(f) == bench.layout_of(b) and f.cluster == b.cluster for f, b in pairs)
    dense = bench.fp8_pairs([r for r in data.all_runs() if r.group == data.HELD_OUT_FP8],
                            [r for r in data.all_runs() if r.group == data.HELD_OUT])
    assert len(dense) == 75 and not any(f.group == data.HELD_OUT_MOE for f, _ in dense)


def test_grok1_gb200_rows_are_launch_sh_s_layout(modules):
    """DGX Cloud's Grok-1 GB200 table as launch.sh runs it: TP 4, expert TP 4, EP 8, no pipeline or
    CP, GBS 2 x GPUs, so 8 micro-batches a data rank; the tokens/s the README prints beside each step
    (286,300.61 at 128 GPUs, 7.325 s) are 8,192 x GBS over the step, to the README's rounding."""
    data, _ = modules
    rows = [r for r in data.all_runs() if r.name.startswith("DGX Cloud GB200 Grok-1")]
    assert len(rows) == 6 and {r.cluster for r in rows} == {"gb200-nvl72"}
    for r in rows:
        assert (r.tp, r.etp, r.ep, r.pp, r.cp, r.mbs, r.global_batch) == (4, 4, 8, 1, 1, 1, 2 * r.gpus)
        assert r.global_batch // (r.gpus // r.tp) == 8
    (first,) = [r for r in rows if r.gpus == 128 and r.precision != "fp8"]
    assert abs(first.tokens_per_step / first.published_step_s - 286300.61) < 1.0


def test_nemotron_3_nano_row_is_the_recipe_s_and_its_flops_are_the_traced_count(modules):
    """Megatron-Bridge 26.06's DGX-H100 Nemotron 3 Nano row (16 GPUs, FP8, GBS 1024, 8K tokens, EP 8,
    14,719 tokens/s and 328 TFLOP/s a GPU): the FLOPs a token those imply (22.28 G) are meshplan's
    trace of the hub config, attention in full (22.02 G), within 2%; 31.58 B parameters (the
    published 31.6 B); the H100 FP8-CS preset's recomputed modules and switches."""
    data, fit = modules
    (run,) = [r for r in data.all_runs() if "Nemotron-3-Nano" in r.name]
    graph = fit.graph_of(run.spec, run.seq, run.attention)
    assert graph.total_params == 31_577_937_344
    per_token = float(graph.fwd_flops + graph.bwd_flops) / run.seq
    assert 328e12 / 14719 == pytest.approx(per_token, rel=0.02)
    assert run.published_tokens_per_s == 14719 * 16 and (run.gpus, run.global_batch, run.seq) == (16, 1024, 8192)
    assert (run.tp, run.pp, run.ep, run.etp, run.mbs, run.zero) == (1, 1, 8, 1, 1, 1)
    assert run.recompute_modules == ("moe", "layernorm", "core_attn", "moe_act")
    assert run.fp8_recipe == "tensorwise" and run.grad_reduce_in_bf16 and run.moe_dispatcher == "deepep"


def test_qwen3_next_row_is_the_modelzoo_s_layout_and_model(modules):
    """The ModelZoo's Qwen3-Next row (128 H100, TP 1, PP 4, VP 3, EP 32, DP 32, MBS 1, GBS 256, GA 8, 2.2 s)
    on the config its model_configs YAML sets: 48 blocks, every fourth gated attention (16 heads, 2 KV
    heads of 256), the others gated DeltaNet (16 key and 32 value heads of 128), 512 experts of 512, top
    10, a shared expert of 512, hidden 2,048; one multi-token-prediction layer, 4 blocks a chunk."""
    import json

    data, fit = modules
    (run,) = [r for r in data.all_runs() if "Qwen3-Next" in r.name]
    config = json.loads(Path(run.spec[3:]).read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (2048, 48, 16, 2, 256)
    assert (config["linear_num_key_heads"], config["linear_num_value_heads"], config["linear_key_head_dim"],
            config["linear_value_head_dim"]) == (16, 32, 128, 128)
    assert config["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 12
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
            config["shared_expert_intermediate_size"]) == (512, 10, 512, 512)
    dp = run.gpus // run.pp
    assert (run.pp, run.vpp_options, run.ep, dp, run.global_batch // dp) == (4, (3,), 32, 32, 8)
    assert run.mtp_num_layers == 1 and run.stage_blocks == (4,) * 12 and run.published_step_s == 2.2
    assert run.recompute_modules == ("layernorm", "moe_act", "shared_experts")
    graph = fit.graph_of(run.spec, run.seq, run.attention)  # Qwen's "80B total parameters"
    assert graph.total_params == pytest.approx(80e9, rel=0.01) and graph.info.num_experts == 512


def test_dgx_cloud_dense_rows_transcription_is_consistent(modules):
    """DGX Cloud's dense tables print each row's tokens/s beside its step time: every transcribed
    row's global batch x sequence over its step gives that figure (0.1%: the steps' printed
    digits), which pins the global batches the recipes set (16 per GPU for 8B, 2 for 70B and GPT-3,
    one per two GPUs for 405B, the proxies' own, 4 for Nemotron-4 15B, one per four GPUs for 340B,
    512 in the GB200 strong-scaling table, 3 per GPU for Nemotron-H 56B); the layouts fill the GPUs; each proxy's blocks
    with the embedding and the loss fill its chunks evenly (the recipe's account_for_* split); and the model
    FLOPs per sample the READMEs print (4.74E+14, 2.17E+16, 2.20E+15) are meshplan's count with
    attention in full (1%), Nemotron-H 56B's (2.816E+15) meshplan's trace of its hybrid layers."""
    data, fit = modules
    dgx = benchmark_module("published_dgx_cloud_runs")
    runs = dgx.dgx_cloud_dense_runs()
    tokens_per_s = {  # (name prefix, precision): the tables' throughput row, in GPU order
        ("8B", "bf16"): (85459, 170500, 340447, 680341, 1360683), ("8B", "fp8"): (112388, 224055, 444783, 884874, 1758618),
        ("70B", "bf16"): (71526, 142955, 285716, 571821, 1145202, 2288843),
        ("70B", "fp8"): (106346, 210769, 419430, 833030, 1664406, 3305855),
        ("405B proxy", "bf16"): (97090, 51910, 53444), ("405B proxy", "fp8"): (148524, 82957, 86090),
        ("405B", "bf16"): (105863, 211406, 422175), ("405B", "fp8"): (161072, 337706, 667883),
        ("GPT-3 175B", "bf16"): (63099, 124712, 249068, 496191, 988057),
        ("GPT-3 175B", "fp8"): (93190, 183157, 363206, 720671, 1407485),
        ("Nemotron-4 15B", "bf16"): (98550, 197101, 392725, 785450, 1565039, 3095427, 6123072, 12069940),
        ("Nemotron-4 15B", "fp8"): (132396, 264792, 529584, 1053845, 2097152, 4152776, 8264638, 16054752),
        ("Nemotron-4 340B", "bf16"): (60125, 119428, 237772, 473398), ("Nemotron-4 340B", "fp8"): (89469, 176528, 349525, 687591),
        # v25.05.04's GB200 tables (128, 256 and 512 GPUs)
        ("GB200 Llama3.1 405B", "bf16"): (56092, 110563, 220567),
        ("GB200 Llama3.1 405B", "fp8"): (85514, 169590, 335867),
        ("GB200 Nemotron-4 340B", "bf16"): (59877, 119700, 235212),
        ("GB200 Nemotron-4 340B", "fp8"): (88383, 172804, 338468),
        ("GB200 Nemotron-4 340B gbs512", "bf16"): (64211, 126486, 247656),
        ("GB200 Nemotron-4 340B gbs512", "fp8"): (96067, 187078, 369998),
        # v25.05.04's Nemotron-H 56B table (FP8 only, 32 to 2,048 GPUs, GBS 3 per GPU)
        ("Nemotron-H 56B", "fp8"): (52016, 104454, 203003, 395888, 807321, 1605168, 3201148)}
    def table(run) -> tuple[str, str]:  # the printed table a run's row is in: (model, precision)
        model, precision = re.match(r"DGX Cloud (?:Llama3\.1 )?(.+?) (bf16|fp8) ", run.name).groups()
        return re.sub(r" \d+ layers$", "", model), precision

    checked = 0
    for (label, precision), figures in tokens_per_s.items():
        rows = [r for r in runs if table(r) == (label, precision)]
        assert len(rows) == len(figures), (label, precision, [r.name for r in rows])
        for run, figure in zip(sorted(rows, key=lambda r: r.gpus), figures):
            assert run.global_batch * run.seq / run.published_step_s == pytest.approx(figure, rel=1e-3), run.name
            assert run.gpus % (run.tp * run.pp * run.cp) == 0 and run.vpp_options[0] >= 1
            checked += 1
    assert checked == len(runs) == 93
    assert {r.cluster for r in runs if "GB200" in r.name} == {"gb200-nvl72"}
    assert all(r.cluster == "h100-sxm" for r in runs if "GB200" not in r.name)
    # every release's recipes reduce gradients in bf16 (Llama 3.1's and Nemotron-4's performance
    # optimizations set grad_reduce_in_fp32 = False; GPT-3's hydra config syncs them in bf16, grad_sync_dtype)
    assert all(run.grad_reduce_in_bf16 for run in runs)
    for run in runs:
        if "proxy" in run.name and run.pp > 1:
            blocks = fit.graph_of(run.spec, run.seq, run.attention).info.num_layers
            assert (blocks + 2) % (run.pp * run.vpp_options[0]) == 0  # 30 + 2 = 32 chunks of 1, 62 + 2 of 2
            assert run.stage_blocks == data.account_for_split(blocks, run.pp * run.vpp_options[0]), run.name
    for spec, seq, per_sample in (("llama3-8b", 8192, 4.74e14), ("llama3-405b", 8192, 2.17e16),
                                  (data.gpt_spec(96, 12288, 96), 2048, 2.20e15),
                                  (f"hf:{dgx.NEMOTRON_H_56B}", 8192, 2.816e15)):
        graph = fit.graph_of(spec, seq, "cudnn")
        assert float(graph.fwd_flops + graph.bwd_flops) == pytest.approx(per_sample, rel=0.01)


def test_mpt_table_transcription_is_consistent(modules):
    """Every transcribed MPT row: global batch = GPUs x micro-batch x accumulation (the loader
    refuses others) and the shapes give the parameter count the tables print (0.1%)."""
    data, fit = modules
    runs = data.mpt_runs()
    assert len(runs) == 191
    graph = fit.graph_of(data.gpt_spec(80, 8192, 64, data.MPT_VOCAB), 2048, "flash")
    assert sum(layer.num_params for layer in graph.layers) == pytest.approx(64862437376, rel=1e-3)


def test_mpt_runs_measured_before_torch_2_1_rerun_their_blocks_whole(modules):
    """The rows whose MP Mode is PURE (the A100 40GB table's 78 and the two 70b A100 80GB rows the
    October 2023 update kept, torch 1.13.1) and the whole micro-batch sweep (torch 2.0.1) turn the
    checkpoint early stop off; the rows measured in that update and the 128-512 GPU table (torch
    2.1) leave it to llm-foundry's rule, which stops early."""
    from meshplan.planner.contracts.engine_rules import early_stop_default

    data, _ = modules
    runs = data.mpt_runs()
    old = [run for run in runs if run.recompute_early_stop is False]
    assert len(old) == 80 and {run.cluster for run in old} == {"a100-40g", "a100-80g"}
    assert {run.name.split()[1] for run in old if run.cluster == "a100-80g"} == {"70b"}
    assert all(data.MPT_OLD_TORCH in run.assumptions for run in old)
    assert all(run.recompute_early_stop is None for run in runs if run.cluster == "h100-sxm")
    assert all(run.recompute_early_stop is False for run in data.mpt_sweep_runs())
    assert all(run.recompute_early_stop is None for run in data.mpt_large_scale_runs())
    assert early_stop_default("llm-foundry")


def test_mpt_micro_batch_sweep_is_transcribed_and_agrees_with_the_readme(modules):
    """The sweep's six runs (two 3b rows with activation CPU offload left out): global batch = GPUs
    x micro-batch x accumulation, and its 13b micro-batch-2 row measures what the README's row of the
    same layout does (18,097 against 17,824 tokens/s: 2%, one accumulation step apart)."""
    data, fit = modules
    sweep = data.mpt_sweep_runs()
    assert len(sweep) == 6 and all(run.source == data.MPT_SWEEP_SOURCE and run.zero == 3 for run in sweep)
    readme = {run.name: run for run in data.mpt_runs()}["MPT 13b a100_80gb s2048 x8 mbs2"]
    same = {run.name: run for run in sweep}["MPT 13b a100_80gb sweep s2048 x8 mbs2"]
    assert same.published_tokens_per_s == pytest.approx(readme.published_tokens_per_s, rel=0.02)
    assert sorted(run.mbs for run in sweep if "7b" in run.name) == [1, 2, 4]


def test_mpt_large_scale_table_is_transcribed_with_its_sharding(modules):
    """The README's 128-512 GPU table: 18 rows, each model at 128, 256 and 512 GPUs with one
    micro-batch a step; SHARD_GRAD_OP rows (1b, 3b) run ZeRO-2, FULL_SHARD rows ZeRO-3; its 70b
    row at 512 GPUs measures 515,636 tokens/s (the published figure becomes a step time of
    4096 x 2048 / 515,636 s)."""
    data, _ = modules
    runs = data.mpt_large_scale_runs()
    assert len(runs) == 18 and all(run.source == data.MPT_LARGE_SCALE_SOURCE for run in runs)
    assert {run.gpus for run in runs} == {128, 256, 512}
    assert all(run.global_batch == run.gpus * run.mbs for run in runs)
    zero = {run.name.split()[1]: run.zero for run in runs}
    assert zero == {"70b": 3, "30b": 3, "13b": 3, "7b": 3, "3b": 2, "1b": 2}
    big = {run.name: run for run in runs}["MPT 70b h100_80gb large s2048 x512 mbs8"]
    assert big.recompute == "full" and big.published_tokens_per_s == 515636.0
    assert set(runs) <= set(data.held_out_runs())


def test_megatron_lm_h100_table_transcription_is_consistent(modules):
    """Every row of the Megatron-LM README's H100 table: TP x PP x DP = GPUs, the printed MFU is
    the TFLOP/s over 989 and the aggregate is TFLOP/s x GPUs (to the table's rounding), and the
    GPT shape gives the size its name states (4h MLP, untied embedding, vocab 131072: 5%)."""
    data, fit = modules
    table = data.MEGATRON_LM_H100_TABLE
    assert len(table) == 9
    for name, heads, hidden, layers, tp, pp, dp, gpus, gbs, tflops, mfu, aggregate in table:
        assert tp * pp * dp == gpus and hidden % heads == 0, name
        assert round(tflops / 989.0 * 100) == mfu, name
        assert tflops * gpus / 1000 == pytest.approx(aggregate, abs=0.06), name
        params = 12 * layers * hidden**2 + 2 * data.VOCAB_131072 * hidden
        assert params == pytest.approx(float(name.rstrip("B")) * 1e9, rel=0.05), name
    runs = data.megatron_lm_h100_runs()
    assert {run.group for run in runs} == {"h100"} and set(runs) <= set(data.fit_runs("h100"))
    assert all(run.engine == "megatron" and run.zero == 1 and run.sp == (run.tp > 1) for run in runs)
    # the spec costs that shape: 1.7B is 24 x 12 x 2048^2 + 2 x 131072 x 2048 weights, plus biases,
    # norms and the 4096-position table (under 1%)
    graph = fit.graph_of(runs[0].spec, runs[0].seq, runs[0].attention)
    assert sum(layer.num_params for layer in graph.layers) == pytest.approx(1744830464, rel=0.01)


def test_megatron_lm_strong_scaling_ends_are_the_177b_row_at_96_and_4608_gpus(modules):
    """The README's strong-scaling series, held out: the 177B row's model and TP 8 x PP 6 at batch
    1,152 on 96 (DP 2) and 4,608 GPUs (DP 96), at the 47% and 42% MFU its text states, so the
    published step is that MFU's model FLOPs: 4,608 GPUs take 96 x 47 / (4,608 x 42) of the 96-GPU
    step."""
    data, fit = modules
    small, large = data.megatron_lm_strong_scaling_runs()
    row = next(run for run in data.megatron_lm_h100_runs() if "177B" in run.name)
    for run, gpus, dp in ((small, 96, 2), (large, 4608, 96)):
        assert (run.spec, run.tp, run.pp, run.global_batch, run.seq) == (row.spec, 8, 6, 1152, 4096)
        assert run.gpus == gpus == run.tp * run.pp * dp and run.group == data.HELD_OUT
    assert small.published_model_tflops_per_gpu == pytest.approx(0.47 * 989)
    ratio = fit.published_step_s(large) / fit.published_step_s(small)
    assert ratio == pytest.approx(96 * 47 / (4608 * 42), rel=1e-9)


def test_unpublished_micro_batches_follow_the_engines_batch_rules(modules):
    """`Run.layouts`: an unpublished micro-batch must split a data rank's batch into whole
    micro-batches, at least one a stage, and under interleaving a multiple of the stages; a
    published one (no `mbs_options`) is taken as printed. The 70B row: 384 / 48 = 8 samples a data
    rank over 2 stages, 42 layers a stage: every count that splits them evenly (1, 2, 3, 6, 7, 14,
    21, 42 virtual stages), as Megatron-LM accepts any; 119B's 23 layers a stage and 462B's 7 leave
    1 or one layer a chunk."""
    data, fit = modules
    runs = {run.name: run for run in data.megatron_lm_h100_runs()}
    row = runs["Megatron-LM H100 GPT 70B tp8 pp2 dp48"]
    assert row.layouts() == tuple((m, v) for m in (1, 2, 4) for v in (1, 2, 3, 6, 7, 14, 21, 42))
    assert runs["Megatron-LM H100 GPT 462B tp8 pp16 dp48"].vpp_options == (1, 7)
    assert runs["Megatron-LM H100 GPT 32B tp8 pp1 dp48"].vpp_options == (1,)  # no pipeline, no chunks
    # 119B: 768 / 48 = 16 samples over 4 stages; micro-batch 4 leaves 4 micro-batches, 8 would leave 2
    row = runs["Megatron-LM H100 GPT 119B tp8 pp4 dp48"]
    assert row.layouts() == tuple((m, v) for m in (1, 2, 4) for v in (1, 23))
    assert {m for m, _ in replace(row, mbs_options=(1, 8)).layouts()} == {1}
    # interleaving needs the micro-batches a multiple of the stages: 6 micro-batches over 4 stages do not
    odd = replace(row, global_batch=48 * 12, vpp_options=(1, 2), mbs_options=(2,))
    assert odd.layouts() == ((2, 1),)
    with pytest.raises(ValueError, match="no micro-batch"):
        replace(row, mbs_options=(32,)).layouts()
    published = replace(row, mbs_options=(), mbs=3, vpp_options=(1, 2))
    assert published.layouts() == ((3, 1), (3, 2))


def test_llama3_rows_chunk_one_layer_each(modules):
    """Llama 3's Table 4 rows run 8 virtual stages a rank: the paper takes one Transformer layer
    from the first and the last stage and says the first chunk then holds only the embedding and
    the last only the output, so a chunk held one layer; 126 layers with the embedding and the
    output in the freed slots make 128 chunks on 16 ranks. meshplan's graph of the model carries
    the same 128 layers (embedding, 126 blocks, head), one to a chunk."""
    data, fit = modules
    rows = data.llama3_runs()
    assert [row.vpp_options for row in rows] == [(8,), (8,)]
    graph = fit.graph_of(rows[0].spec, rows[0].seq, rows[0].attention)
    kinds = [layer.kind for layer in graph.layers]
    assert (kinds[0], kinds[-1], kinds.count("block"), len(kinds)) == ("embedding", "head", 126, 128)
    assert len(kinds) == rows[0].pp * rows[0].vpp_options[0]


def test_larger_unpublished_micro_batches_are_scored_only_where_they_fit(modules):
    """A micro-batch above the least is kept only where the memory model says it fits: the 32B row
    (TP 8, 4 samples a data rank) fits micro-batch 4 on an 80 GB H100 but not on a 16 GB part."""
    data, fit = modules
    row = next(r for r in data.megatron_lm_h100_runs() if "32B" in r.name)
    h100 = load_cluster("h100-sxm")
    assert fit.layouts(row, h100) == ((1, 1), (2, 1), (4, 1))
    small = replace(h100, name="h100-16g", device=replace(h100.device, memory_bytes=16 * 2**30))
    assert fit.layouts(row, small) == ((1, 1),)
    assert len(fit.predictions(row, h100)) == 3


def test_least_squares_recovers_a_box_constrained_minimum(modules):
    _, fit = modules
    unit = fit.least_squares(lambda u: np.array([u[0] - 0.3, 2 * (u[1] - 0.7)]), np.array([0.9, 0.1]))
    assert unit == pytest.approx([0.3, 0.7], abs=1e-4)
    clipped = fit.least_squares(lambda u: np.array([u[0] - 1.5]), np.array([0.5]))  # optimum outside
    assert clipped == pytest.approx([1.0])


def test_fit_recovers_a_known_matmul_efficiency(modules):
    """Published step times generated with matmul_efficiency 0.6 (and elementwise 3.0): the fit,
    started from the shipped values, finds them again from the log step-time errors."""
    data, fit = modules
    truth = {fit.A100_PARAMS[0]: 0.6, fit.A100_PARAMS[2]: 3.0}
    true_cluster = fit.with_values(load_cluster("a100-80g"), truth)
    runs = []
    for layers, hidden, heads, tp, mbs in ((4, 1024, 16, 1, 4), (4, 2048, 16, 2, 2), (2, 4096, 32, 8, 1)):
        run = data.Run(f"synthetic {hidden}", "a100", "synthetic", "a100-80g", data.gpt_spec(layers, hidden, heads),
                       16, 64, 1024, tp=tp, mbs=mbs, recompute="full", published_step_s=1.0)
        runs.append(replace(run, published_step_s=fit.predict(run, true_cluster, 1).step_time_s))
    base = {"a100-80g": load_cluster("a100-80g")}
    params = (fit.A100_PARAMS[0], fit.A100_PARAMS[2])
    start = {p: getattr(base["a100-80g"].device, p.field) for p in params}
    fitted = fit.fit_params(runs, base, params, "a100-80g", start)
    assert fitted[params[0]] == pytest.approx(0.6, rel=1e-3)
    assert fitted[params[1]] == pytest.approx(3.0, rel=1e-2)
    assert np.abs(fit.residuals(runs, {"a100-80g": fit.with_values(base["a100-80g"], fitted)})).max() < 1e-3


def test_set_field_rewrites_one_value_in_its_table(modules):
    _, fit = modules
    text = "[device]\nmatmul_efficiency = 0.7   # old\n\n[topology.inter_node]\nefficiency = 0.85\n"
    out = fit.set_field(text, "topology.inter_node", "efficiency", 0.9661, "fitted")
    assert "efficiency = 0.966" in out and "matmul_efficiency = 0.7   # old" in out
    out = fit.set_field(out, "device", "matmul_efficiency", 4.25e9, "fitted")
    assert "matmul_efficiency = 4.25e9" in out and out.count("# fitted") == 2
    with pytest.raises(ValueError, match="no bogus"):
        fit.set_field(text, "device", "bogus", 1.0, "x")


def test_regressions_are_the_engine_maintainers_words_on_held_out_moe_runs(modules):
    """Only held-out MoE runs carry a regression note, each citing the engine's issue; they stay
    in the scored set (the benchmark's headline counts them)."""
    data, _ = modules
    flagged = {run.name: run for run in data.all_runs() if run.regression}
    assert set(flagged) == {"Megatron-Bridge Qwen3-30B-A3B fp8 pp2 vpp24 ep8",
                            "Megatron-Bridge B200 Qwen3-235B-A22B fp8 pp8 vpp2 ep8",
                            "Megatron-Bridge B200 Qwen3-30B-A3B fp8 ep8"}
    for run in flagged.values():
        assert run.group == data.HELD_OUT_MOE and "issue #" in run.regression and run.engine == "megatron"
    assert all(run.engine == "megatron" for run in data.all_runs()
               if run.group == data.HELD_OUT_MOE and run.source.startswith("Megatron-Bridge"))


def test_on_validated_reads_the_runs_of_validated_profiles_alone(modules):
    """Beside a regime that holds runs on profiles that are not validated, bench_fidelity prints
    what the rest read: one H100 SXM run published at 10 s and predicted 11 s (+10%) with one GB200
    run predicted 30% too fast read 10% on the validated profile alone, and its rule figure is
    the rule's own on that run; a set of validated runs only, or of unvalidated only, adds nothing."""
    data, _ = modules
    bench = benchmark_module("bench_fidelity")
    runs = data.all_runs()
    h100 = next(r for r in runs if r.cluster == "h100-sxm" and r.published_step_s)
    gb200 = next(r for r in runs if r.cluster == "gb200-nvl72" and r.published_step_s)
    clusters = {name: load_cluster(name) for name in ("h100-sxm", "gb200-nvl72")}
    validated = bench.Scored(h100, 10.0, (11.0,), True, ((1, 1),))
    unvalidated = bench.Scored(gb200, 10.0, (7.0,), True, ((1, 1),))
    rule = bench.metrics([validated], clusters)["rule"]
    expected = f"; on validated profiles: 10.0% over 1 (the rule {rule:.1%})"
    assert bench.on_validated([validated, unvalidated], clusters) == expected
    assert bench.on_validated([validated], clusters) == bench.on_validated([unvalidated], clusters) == ""


def test_layout_band_reads_what_unpublished_layouts_leave_open(modules):
    """Two runs published at 1 s: one scored over options predicting 0.9 and 1.2 s (inside, a
    range 1.2 / 0.9 - 1 = 33.3% wide, nearest option 10% off), one at a single 1.05 s layout (5%
    off): 1 of 2 scored over several, inside in 1, nearest-option mean (10% + 5%) / 2 = 7.5%."""
    bench = benchmark_module("bench_fidelity")
    several = bench.Scored(None, 1.0, (0.9, 1.2), True, ((1, 1), (1, 2)))
    single = bench.Scored(None, 1.0, (1.05,), True, ((1, 1),))
    line = bench.layout_band([several, single])
    assert "1 of 2 runs scored over several" in line and "predictions in 1;" in line
    assert "spans 33.3% (median, max 33.3%)" in line and "would read 7.5%" in line
    assert bench.layout_band([single]) is None


def test_shipped_profiles_carry_the_h100_fit_by_their_formulas(modules):
    """What the fit writes beside h100-sxm's fitted `matmul_efficiency` follows from it and from
    published ceilings, not from a run: every part that takes it carries it; fp8 is it times the
    FP8 / BF16 shares of peak of one mamf-finder sweep (70.9% / 80.3%, ml-engineering), mi300x's
    it times MI300X's / H100's measured BF16 ceilings (60.1% / 80.1%), B200's and GB200's it times
    their own BF16 and FP8 ceilings over H100's BF16 one (the same sweep's edition), the size curve's half-way
    FLOPs a100-80g's times the BF16 peak ratio 989 / 312; each to the 3 digits the profiles hold."""
    _, fit = modules
    h100, a100 = load_cluster("h100-sxm").device, load_cluster("a100-80g").device
    for name in fit.H100_COPIES:
        device = load_cluster(name).device
        assert device.matmul_efficiency == h100.matmul_efficiency, name
        assert device.fp8_matmul_efficiency == pytest.approx(h100.matmul_efficiency * 70.9 / 80.3, abs=1e-3), name
    assert load_cluster("mi300x").device.matmul_efficiency == pytest.approx(h100.matmul_efficiency * 60.1 / 80.1,
                                                                             abs=1e-3)
    # the Blackwell parts: each dtype's efficiency scaled by the part's own measured ceiling in it over
    # H100's BF16 one, the same table edition (B200 77.6% / 76.3%, GB200 72.9% / 72.3%, H100 80.3%)
    for name, bf16, fp8 in (("b200", 77.6, 76.3), ("gb200-nvl72", 72.9, 72.3)):
        device = load_cluster(name).device
        assert device.matmul_efficiency == pytest.approx(h100.matmul_efficiency * bf16 / 80.3, abs=1e-3), name
        assert device.fp8_matmul_efficiency == pytest.approx(h100.matmul_efficiency * fp8 / 80.3, abs=1e-3), name
        assert (device.attention_efficiency, device.matmul_half_efficiency_flops) == (
            h100.attention_efficiency, h100.matmul_half_efficiency_flops), name
    assert h100.matmul_half_efficiency_flops == pytest.approx(a100.matmul_half_efficiency_flops * 989 / 312, rel=5e-3)


def test_rowwise_filter_rows_are_the_async_tp_table_s_70b_job_with_k_and_v_in_bf16(modules):
    """torchtitan's auto-filter commit measured the async-TP table's 70B job with wk and wv left in
    bf16: each of its two rows is the table's rowwise row of the same TP mode in every setting but
    the filter, pairs with the table's BF16 row of that mode, and reaches the prediction: the step
    is shorter than the unfiltered row's (k and v's 128-column shards run faster in bf16 at this
    shape, `fp8_advice`), by under 2% (the two Linears are about 2% of the block's FLOPs)."""
    data, fit = modules
    runs = data.all_runs()
    filtered = [r for r in runs if r.source == data.TORCHTITAN_ROWWISE_FILTER]
    assert len(filtered) == 2 and all(r.fp8_filter == ("k", "v") and r.group == data.HELD_OUT_FP8 for r in filtered)
    cluster = load_cluster("h100-96g-500w")
    for run in filtered:
        table = [r for r in runs if r.source == data.TORCHTITAN_ASYNC_TP and r.spec == run.spec
                 and r.tp_comm_overlap == run.tp_comm_overlap]
        unfiltered = next(r for r in table if r.fp8_recipe == "rowwise")
        assert replace(run, name=unfiltered.name, source=unfiltered.source, fp8_filter=(), bf16_baseline_source="",
                       published_tokens_per_s=unfiltered.published_tokens_per_s,
                       assumptions=unfiltered.assumptions) == unfiltered
        assert run.bf16_baseline_source == data.TORCHTITAN_ASYNC_TP
        assert any(r.precision == "bf16-mixed" for r in table)
        mine, theirs = fit.predict(run, cluster, vpp=1), fit.predict(unfiltered, cluster, vpp=1)
        assert 0.98 * theirs.step_time_s < mine.step_time_s < theirs.step_time_s
