"""Hugging Face causal LMs (`hf:config.json`) train with tensor and pipeline parallelism like one process.

Each dense family among the published fixtures, shrunk to 2 decoder layers (same structure,
small widths): Llama 3, Phi-3 (fused qkv_proj and gate_up_proj), GPT-NeoX / Pythia (per-head
fused query_key_value, parallel residual, partial rotary), Gemma-2 (sliding and global layers,
eager attention, soft-capping, tied embedding), Qwen3 (q/k norms; a small dense config) and Falcon
(the 7B config with `new_decoder_architecture` and 2 K/V heads, parallel attention and MLP: the
grouped fused layout). Every one runs with TP=2 and with PP=2 (1F1B), DeepSeek-V3 (latent
attention, a dense then a MoE layer) with PP=2, and OLMo-2, StarCoder2 and DeepSeek-V2-Lite's
latent attention with TP=2; a few add interleaved and
V-shaped schedules (a chunk of the embedding alone, one of the head alone, the tied weight on
two ranks or twice on one) and recomputation. All jobs run in one torchrun launch of 2 gloo
processes.

The reference is a single-process loop written here (as in test_hf_train.py): transformers'
weights under `torch.manual_seed(seed)`, the whole global batch in one forward, the next-token
loss, clipping to norm 1, AdamW and the warm-up + cosine schedule.

Tolerance: 1e-5 relative on every loss. All fp32 on CPU; a layout differs from the reference only
in summation order (row-parallel matmuls summed by an all-reduce, micro-batch means, the
float64 norm), a few 1e-7 per step on a loss of ~5.7; a wrong head permutation, a lost head
count or a missing gradient moves the loss at step 2 by far more than 1e-4.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

FIXTURES = Path(__file__).parents[1] / "planner" / "models" / "hf_configs"
SEQ, GBS, STEPS, LR, SEED = 16, 4, 4, 2e-3, 0
RTOL = 1e-5
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)


def shrunk_config(tmp_path, name: str, **overrides) -> str:
    """A published config (or a plain one of `model_type` name) with the SMALL widths it has."""
    path = FIXTURES / f"{name}.json"
    data = json.loads(path.read_text()) if path.exists() else {"model_type": name, **SMALL}
    for key in ("bos_token_id", "eos_token_id"):
        data.pop(key, None)
    data["pad_token_id"] = None  # published ids lie beyond the small vocabulary
    data.update({key: value for key, value in SMALL.items() if key in data})
    data.update(overrides)
    out = tmp_path / f"{name}.json"
    out.write_text(json.dumps(data))
    return f"hf:{out}"


def family_specs(tmp_path) -> dict[str, str]:
    return {
        "llama": shrunk_config(tmp_path, "llama3_8b"),
        "phi3": shrunk_config(tmp_path, "phi3_mini_4k"),
        "neox": shrunk_config(tmp_path, "pythia_160m"),
        "gemma2": shrunk_config(tmp_path, "gemma2_9b", tie_word_embeddings=True),
        "qwen3": shrunk_config(tmp_path, "qwen3", tie_word_embeddings=True),
        # Falcon-7B's 71 heads and single K/V head split no tp ways: the grouped layout with 2 K/V heads
        "falcon": shrunk_config(tmp_path, "falcon_7b", new_decoder_architecture=True, multi_query=False,
                                num_kv_heads=2),
    }


def deepseek_spec(tmp_path) -> str:
    """DeepSeek-V3 shrunk: a dense layer then a MoE layer, multi-head latent attention. Its routed
    experts are not split by the executor (train refuses tp > 1), but it pipelines: one more PP=2
    case."""
    return shrunk_config(tmp_path, "deepseek_v3", num_key_value_heads=4, moe_intermediate_size=32,
                         first_k_dense_replace=1, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                         q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         rope_scaling=None)


def tp_only_specs(tmp_path) -> dict[str, str]:
    """Families checked with TP=2 alone: OLMo-2 (q/k norms over all heads, split with them),
    StarCoder2 (biases everywhere, c_fc/c_proj MLP, LayerNorm) and DeepSeek-V2-Lite's multi-head
    latent attention without a query low rank (every layer dense here)."""
    return {
        "olmo2": shrunk_config(tmp_path, "olmo2_7b"),
        "starcoder2": shrunk_config(tmp_path, "starcoder2_15b", attention_dropout=0.0, residual_dropout=0.0,
                                    embedding_dropout=0.0),
        "mla": shrunk_config(tmp_path, "deepseek_v2_lite", num_key_value_heads=4, first_k_dense_replace=2,
                             n_routed_experts=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=16, rope_scaling=None),
    }


LAYOUTS = {
    "tp2": dict(tp=2, microbatch_size=2),
    "pp2": dict(pp=2, microbatch_size=1, schedule="1f1b"),
}
EXTRA = {  # (family, name): layout
    ("llama", "pp2-interleaved"): dict(pp=2, microbatch_size=1, schedule="interleaved", virtual_stages=2),
    ("gemma2", "pp2-interleaved"): dict(pp=2, microbatch_size=2, schedule="interleaved", virtual_stages=2),
    ("gemma2", "pp2-zbv"): dict(pp=2, microbatch_size=1, schedule="zbv", virtual_stages=2),
    ("phi3", "tp2-full"): dict(tp=2, microbatch_size=2, recompute="full"),
    ("neox", "pp2-selective"): dict(pp=2, microbatch_size=1, recompute="selective"),
    ("deepseek", "pp2"): dict(pp=2, microbatch_size=1),
    ("olmo2", "tp2"): dict(tp=2, microbatch_size=2),
    ("starcoder2", "tp2"): dict(tp=2, microbatch_size=2),
    ("mla", "tp2"): dict(tp=2, microbatch_size=2),
}


def reference_losses(spec: str) -> list[float]:
    from tests.process_helpers import hf_reference_losses

    return hf_reference_losses(spec, SEQ, GBS, STEPS, LR, SEED)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_hf_families_train_with_tp2_and_pp2_like_one_process(run_cli, tmp_path):
    from meshplan.executor.launch import launch_jobs
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.contracts.plan import load_plan, save_plan
    from meshplan.planner.costing.hardware import load_cluster

    cluster = load_cluster("cpu")
    specs = family_specs(tmp_path)
    cases = {(family, layout): options for family in specs for layout, options in LAYOUTS.items()}
    specs["deepseek"] = deepseek_spec(tmp_path)
    specs.update(tp_only_specs(tmp_path))
    cases.update(EXTRA)
    jobs = []
    for (family, layout), options in cases.items():
        name = f"{family}-{layout}"
        plan = uniform_plan(specs[family], SEQ, GBS, cluster, seed=SEED, **options)
        assert plan.config.gpus == 2, name
        save_plan(plan, tmp_path / f"{name}.plan.json")
        jobs.append({"plan_path": str(tmp_path / f"{name}.plan.json"), "steps": STEPS, "lr": LR,
                     "out": str(tmp_path / f"{name}.measured.json"), "measure_memory": False})
    # `plan` on the Llama config accepts a tp pin now, and its plan trains like the others
    planned = tmp_path / "llama-planned.plan.json"
    code, _, err = run_cli("plan", "--model", specs["llama"], "--cluster", "cpu", "--gpus", 2, "--gbs", GBS,
                           "--seq", SEQ, "--tp", 2, "--precision", "fp32", "--out", planned)
    assert code == 0, err
    assert load_plan(planned).config.tp == 2 and not load_plan(planned).config.sp
    cases[("llama", "planned")] = {}
    jobs.append({"plan_path": str(planned), "steps": STEPS, "lr": LR, "seed": SEED,
                 "out": str(tmp_path / "llama-planned.measured.json"), "measure_memory": False})
    launch_jobs(jobs, 2, tmp_path / "run", timeout_s=250)
    references = {family: reference_losses(spec) for family, spec in specs.items()}
    failures = []
    for family, layout in cases:
        got = json.loads((tmp_path / f"{family}-{layout}.measured.json").read_text())["losses"]
        expected = references[family]
        assert len(got) == STEPS and abs(expected[-1] - expected[0]) > 1e-3  # the weights did change
        worst = max(abs(g - e) / abs(e) for g, e in zip(got, expected))
        if worst > RTOL:
            failures.append(f"{family}-{layout}: relative error {worst:.2e}; got {got}, single-process {expected}")
    assert not failures, "\n".join(failures)


def test_fused_rows_are_permuted_so_each_rank_shard_holds_its_heads():
    import torch

    from meshplan.executor.parallel.hf import _permute_rows

    # Phi-3's qkv_proj: 4 query heads, 2 K/V heads of 2 rows each: [q0..q3 | k0 k1 | v0 v1]
    linear = torch.nn.Linear(3, 16, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.arange(16.0)[:, None].expand(16, 3))
        linear.bias.copy_(torch.arange(16.0))
        _permute_rows(linear, [(0, 8), (8, 4), (12, 4)], 2)
    rows = linear.weight[:, 0].tolist()
    # rank 0: q heads 0-1, k head 0, v head 0; rank 1: q heads 2-3, k head 1, v head 1
    assert rows == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]
    assert linear.bias.tolist() == rows


def test_train_refuses_hf_plans_it_cannot_run(tmp_path):
    from meshplan.executor.checks import check_plan_runnable
    from meshplan.executor.plans import uniform_plan
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.costing.hardware import load_cluster

    cluster = load_cluster("cpu")
    llama = family_specs(tmp_path)["llama"]
    with pytest.raises(MeshplanError, match="sequence parallelism is not implemented for Hugging Face models"):
        check_plan_runnable(uniform_plan(llama, SEQ, GBS, cluster, tp=2, sp=True, microbatch_size=2), 2)
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300,
                                "n_positions": 64}))
    with pytest.raises(MeshplanError, match="tp=2: layer 'blocks.0' cannot be split over tensor-parallel ranks: no attention"):
        check_plan_runnable(uniform_plan(f"hf:{gpt2}", SEQ, GBS, cluster, tp=2, microbatch_size=2), 2)
    # DeepSeek-V3: its latent attention splits, but the executor does not split transformers' experts
    with pytest.raises(MeshplanError, match=r"the executor trains Hugging Face mixture-of-experts models with tp=1 "
                                            r"\(this plan has tp=2\): it does not split transformers' routed experts; "
                                            r"re-plan with --tp 1"):
        check_plan_runnable(uniform_plan(deepseek_spec(tmp_path), SEQ, GBS, cluster, tp=2, microbatch_size=2), 2)
