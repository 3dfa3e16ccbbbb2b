"""Hybrid Hugging Face models (Nemotron-H): their Mamba-2 mixers split over TP as Megatron-Core splits
them, their attention-only and MLP-only layers split alone, what the Megatron memory and kernel rules
read of each block, and the executor's one-line refusal."""
from __future__ import annotations

import json

import pytest

from meshplan.planner.contracts.errors import MeshplanError

pytest.importorskip("transformers")

# A small Nemotron-H: 8 Mamba heads of 32 in 2 groups of state 16 (inner 256), 4 attention heads of 64
# with 2 K/V heads, a 512-wide squared-ReLU MLP; layers Mamba, MLP, attention, MLP.
TINY = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 256,
        "num_hidden_layers": 4, "hybrid_override_pattern": "M-*-", "mamba_num_heads": 8, "mamba_head_dim": 32,
        "n_groups": 2, "ssm_state_size": 16, "chunk_size": 16, "conv_kernel": 4, "expand": 2,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1024, "max_position_embeddings": 256, "mlp_hidden_act": "relu2", "tie_word_embeddings": False,
        "use_bias": False, "mlp_bias": False, "use_conv_bias": True, "mamba_proj_bias": False}
SEQ = 64


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("nemotron_h") / "nemotron_h_tiny.json"
    path.write_text(json.dumps(TINY))
    return f"hf:{path}"


@pytest.fixture(scope="module")
def graph(tiny_spec):
    from meshplan.planner.profiling.profiler import profile

    return profile(tiny_spec, SEQ, cache=False)


def _blocks(graph) -> dict:
    """mixer -> the first block with that mixer."""
    out = {}
    for layer in graph.layers:
        if layer.kind == "block":
            out.setdefault(layer.tp_split.mixer, layer)
    return out


def test_each_layer_splits_by_what_it_holds(graph):
    blocks = _blocks(graph)
    mamba, mlp, attention = blocks["mamba2"].tp_split, blocks["none"].tp_split, blocks["attention"].tp_split
    # Megatron-Core's MambaMixer: in_proj column-parallel, out_proj row-parallel, one all-reduce
    assert (mamba.kind, mamba.column_linears, mamba.row_linears) == ("block", ("mixer.in_proj",), ("mixer.out_proj",))
    assert (mamba.num_heads, mamba.num_kv_heads, mamba.num_allreduce_per_pass, mamba.mlp) == (8, 2, 1, "none")
    assert (mlp.column_linears, mlp.row_linears, mlp.mlp_width, mlp.mlp) == (
        ("mixer.up_proj",), ("mixer.down_proj",), 512, "plain")
    assert (attention.column_linears, attention.row_linears) == (
        ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"), ("mixer.o_proj",))
    assert (attention.num_heads, attention.num_kv_heads, attention.mlp) == (4, 2, "none")
    # a tp divides the Mamba heads and the groups: 2 does, 4 does not (2 groups)
    assert mamba.max_degree_ok(2) and not mamba.max_degree_ok(4)
    assert mamba.divisors_text() == "8 Mamba heads, 2 groups"
    assert all(split.executor_refusal for split in (mamba, mlp, attention))


def test_model_info_reads_the_mamba2_shape_and_its_scan_flops(graph):
    from meshplan.planner.costing.gemm import block_linear_shapes

    info = graph.info
    assert (info.mamba_heads, info.mamba_head_dim, info.mamba_groups, info.mamba_state, info.mamba_chunk) == (
        8, 32, 2, 16, 16)
    assert info.mamba_in_proj_width == 2 * 256 + 2 * 2 * 16 + 8 == 584
    # the traced forward FLOPs are the two Linears', the chunked scan's four products and the depthwise
    # conv's, exactly: 4 chunks of 16; per chunk 2 groups x (16 x 16 x 16) and 8 heads x 32 x 16 x (16 + 2 x 16)
    mamba = _blocks(graph)["mamba2"]
    scan = 2 * 4 * (2 * 16 * 16 * 16 + 8 * 32 * 16 * 48)
    assert info.mamba_scan_fwd_flops(SEQ) == scan == 1_638_400
    assert mamba.fwd_flops - mamba.conv_fwd_flops == 2 * SEQ * (256 * 584 + 256 * 256) + scan
    assert block_linear_shapes(mamba, info, SEQ) == ((256, 584, True), (256, 256, False))
    assert block_linear_shapes(_blocks(graph)["none"], info, SEQ) == ((256, 512, True), (512, 256, False))


def test_megatron_keeps_what_its_fused_mamba2_kernels_keep(graph):
    """Per token on one rank at tp 2 with SP, bf16 (b = 2): the norm's input and output (2 x 2 x 256 / 2),
    in_proj's output (2 x 584 / 2), the scan's output and the gated norm's input (2 x 256 / 2 each) with
    an fp32 rstd per group (4 x 2 / 2), out_proj's input (2 x 256 / 2): 512 + 584 + 256 + 260 + 256."""
    from meshplan.planner.costing.megatron_activations import block_terms
    from meshplan.planner.simulation.estimator import parallel_config

    from meshplan.planner.costing.hardware import load_cluster

    config = parallel_config(load_cluster("h100-sxm"), gpus=2, global_batch=2, tp=2, sp=True, engine="megatron")
    blocks = _blocks(graph)
    mamba = block_terms(blocks["mamba2"], config, graph.info, "flash", SEQ)
    assert sum(term.bytes_per_token for term in mamba) == 512 + 584 + 256 + 260 + 256
    assert not any("attention" in term.name or "MLP" in term.name for term in mamba)
    # an MLP-only layer keeps no attention terms, an attention-only layer no MLP terms; squared ReLU
    # is not gated: fc1's output once (2 x 512 / 2)
    mlp = {term.name: term.bytes_per_token for term in block_terms(blocks["none"], config, graph.info, "flash", SEQ)}
    assert not any("attention" in name for name in mlp) and mlp["MLP: fc1 output"] == 512
    attention = block_terms(blocks["attention"], config, graph.info, "flash", SEQ)
    assert not any("MLP" in term.name for term in attention)


def test_estimate_prices_tp_over_mamba2_and_train_refuses_it(graph, tiny_spec):
    from meshplan.planner.costing.executable import model_facts, tp_split_problem, why_not_executable
    from meshplan.planner.simulation.estimator import estimate, parallel_config

    from meshplan.planner.costing.hardware import load_cluster

    one = estimate(tiny_spec, "h100-sxm", 2, 4, seq=SEQ, engine="megatron")
    two = estimate(tiny_spec, "h100-sxm", 2, 4, seq=SEQ, tp=2, sp=True, engine="megatron")
    assert two.peak_memory_bytes < one.peak_memory_bytes  # the mixers' weights and activations split
    with pytest.raises(MeshplanError, match=r"does not divide layer 'blocks.0': 8 Mamba heads, 2 groups"):
        estimate(tiny_spec, "h100-sxm", 4, 4, seq=SEQ, tp=4, sp=True, engine="megatron")
    facts = model_facts(graph)
    assert tp_split_problem(facts, 2) is None
    with pytest.raises(MeshplanError, match=r"--cp 2: layer 'blocks.0' is a state-space mixer, whose context "
                                            r"parallelism .* meshplan does not price; use --cp 1"):
        estimate(tiny_spec, "h100-sxm", 2, 4, seq=SEQ, cp=2, engine="megatron")
    config = parallel_config(load_cluster("h100-sxm"), gpus=2, global_batch=4, tp=2)
    why = why_not_executable(config, facts)
    assert why.startswith("tp=2: meshplan's executor does not split Mamba-2 mixers") and "--tp 1" in why


def test_the_search_keeps_tp_for_an_engine_and_drops_it_for_the_executor(graph):
    """meshplan's executor splits neither the mixers nor the sequence of a Hugging Face model; Megatron-Core
    splits both (`engine_rules.SEQUENCE_SPLIT_ENGINES`), so under it TP comes with and without SP."""
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.search.candidates import Pins, enumerate_candidates

    cluster = load_cluster("h100-sxm")
    assert {(c.tp, c.sp) for c in enumerate_candidates(graph, cluster, 4, 8, Pins(zero=1, mbs=1))} == {(1, False)}
    megatron = enumerate_candidates(graph, cluster, 4, 8, Pins(zero=1, mbs=1), engine="megatron")
    assert {(c.tp, c.sp) for c in megatron} == {(1, False), (2, False), (2, True)}
    assert all(c.cp == 1 for c in megatron)  # no CP over state-space mixers


def test_megatron_export_writes_the_hybrid_pattern_with_the_plan_s_cut_and_reads_it_back(tiny_spec):
    """`export --to megatron` of a Nemotron-H plan: Megatron-Core's hybrid arguments (no --num-layers: the
    pattern says it) and `--hybrid-layer-pattern` with `|` after each chunk's last decoder layer; read back,
    the same depth, chunks and virtual stages; a pattern without `|` is Megatron's even split."""
    from dataclasses import replace

    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.engines.megatron import export_megatron, read_megatron

    plan = uniform_plan(tiny_spec, SEQ, 8, load_cluster("h100-sxm"), tp=2, pp=2, dp=1, microbatch_size=1, zero=1,
                        schedule="1f1b", virtual_stages=1, recompute="none", sp=True, precision="bf16-mixed")
    plan = replace(plan, config=replace(plan.config, engine="megatron"))
    # re-cut: the embedding and blocks 0-2 on the first stage, block 3 and the head on the second
    chunk_of = (0, 0, 0, 0, 1, 1)
    plan = replace(plan, layers=tuple(replace(layer, stage=chunk) for layer, chunk in zip(plan.layers, chunk_of)))
    text, notes = export_megatron(plan)
    lines = text.splitlines()
    assert "pretrain_hybrid.py" in lines[1] and "--num-layers" not in text
    assert "--hybrid-layer-pattern 'M-*|-'" in lines and "--mamba-num-groups 2" in lines and "--squared-relu" in lines
    assert any("--hybrid-layer-pattern" in note for note in notes)
    job = read_megatron(text)
    assert (job.pp, job.vpp, job.layers_per_chunk) == (2, 1, (4, 2))
    even = read_megatron(text.replace("'M-*|-'", "'M-*-'"))
    assert even.layers_per_chunk == (3, 3)  # 4 layers over 2 stages, the embedding and the head added


def test_a_moe_only_layer_splits_its_shared_experts_and_routed_experts_widths(tmp_path):
    """Nemotron 3's E layers (a MoE alone: router, routed experts of squared ReLU, shared experts): the
    shared experts' Linears column- and row-parallel, one all-reduce a pass, the experts' width and
    the shared experts' (256 and 128 here; gcd 128) for a tp to divide; the hidden size read off the
    layer's norm, since a plain expert's two weights both hold it and the expert width."""
    from meshplan.planner.profiling.profiler import profile

    config = {**TINY, "hybrid_override_pattern": "M*E-", "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 256, "n_shared_experts": 1,
              "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0}
    path = tmp_path / "nemotron_h_moe.json"
    path.write_text(json.dumps(config))
    graph = profile(f"hf:{path}", SEQ, cache=False)
    moe = next(layer for layer in graph.layers if layer.expert_params)
    split = moe.tp_split
    assert (split.kind, split.mixer, split.mlp, split.num_allreduce_per_pass, split.mlp_width) == (
        "block", "none", "plain", 1, 128)
    assert split.row_linears == ("mixer.shared_experts.down_proj",) and split.executor_refusal


def test_megatron_export_writes_a_hybrid_s_moe_layers(tmp_path):
    """Nemotron 3's E layers exported as Megatron-Core's MoE: experts, top-k, widths (the shared
    experts' their own), the sigmoid router with its expert bias and scaling factor."""
    from meshplan.planner.engines.megatron_hf import hf_megatron_args

    config = {**TINY, "hybrid_override_pattern": "M*E-", "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 256, "n_shared_experts": 1,
              "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5}
    path = tmp_path / "nemotron_h_moe.json"
    path.write_text(json.dumps(config))
    args = dict(hf_megatron_args(str(path), []))
    assert (args["--num-experts"], args["--moe-router-topk"], args["--moe-ffn-hidden-size"]) == (4, 2, 128)
    assert args["--moe-shared-expert-intermediate-size"] == 256 and args["--moe-router-score-function"] == "sigmoid"
    assert args["--moe-router-topk-scaling-factor"] == 2.5 and "--moe-router-enable-expert-bias" in args
    assert "--moe-router-num-groups" not in args and args["--squared-relu"] is None
