"""Attention masks of Hugging Face models as transformers builds them. On a real device meshplan
passes no mask, so transformers builds each layer's own: a sliding window where the layer has one
(Phi-3, Gemma-2), an additive float mask for eager attention (Gemma-2), and none for purely causal
SDPA layers, which then run the causal kernel. (A ready boolean mask, as the meta-device profile
needs, would give a sliding layer the whole prefix, and eager attention adds a boolean mask to
its scores as 0/1.) The profile costs what runs: under SDPA the causal half is skipped unless a
window shorter than the sequence keeps an explicit mask; an architecture transformers runs only
eagerly (Gemma-2) is profiled as the fused kernel the engines run, SDPA on the same masks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "hf_configs"
SEQ, WINDOW = 48, 16
SHRINK = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _shrunk(tmp_path, fixture: str, **extra) -> str:
    config = json.loads((FIXTURES / fixture).read_text())
    config.update(SHRINK, **extra)
    path = tmp_path / fixture
    path.write_text(json.dumps(config))
    return f"hf:{path}"


@pytest.mark.parametrize("fixture, extra", [
    ("gemma2_9b.json", dict(head_dim=16, sliding_window=WINDOW, sliding_window_size=WINDOW)),
    ("phi3_mini_4k.json", dict(sliding_window=WINDOW))])
def test_forward_on_a_real_device_is_transformers_own(tmp_path, fixture, extra):
    import torch

    from meshplan.planner.models.registry import build_model

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    built = build_model(_shrunk(tmp_path, fixture, **extra), SEQ, device="cpu")
    tokens = torch.randint(0, 256, (2, SEQ))
    with torch.no_grad():
        ours = built.forward_fn(built.module, (tokens,))
        theirs = built.module(input_ids=tokens, use_cache=False).logits
        ready = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None]
        with_ready_mask = built.module(input_ids=tokens, attention_mask=ready, use_cache=False).logits
    assert torch.equal(ours, theirs)
    assert not torch.allclose(with_ready_mask, theirs, atol=1e-4)  # what meshplan used to pass


def test_profile_skips_the_entries_no_query_sees(tmp_path):
    from meshplan.planner.profiling.profiler import profile

    pytest.importorskip("transformers")

    def savings(spec: str, seq: int) -> list[int]:
        graph = profile(spec, seq, dtype="fp32", cache=False)
        return [layer.fwd_flops - layer.causal_fwd_flops for layer in graph.layers if layer.kind == "block"]

    def causal_half(seq: int, head_dim: int) -> int:
        attention_fwd = 4 * seq * seq * 4 * head_dim  # QK^T and x V over 4 heads, 2 FLOPs per multiply-add
        return attention_fwd * (seq - 1) // (2 * seq)

    def unseen(seq: int, window: int, head_dim: int) -> int:
        from meshplan.planner.profiling.tracing import seen_entries

        attention_fwd = 4 * seq * seq * 4 * head_dim
        return attention_fwd * (seq * seq - seen_entries(seq, window)) // (seq * seq)

    phi3 = _shrunk(tmp_path, "phi3_mini_4k.json", sliding_window=WINDOW)  # SDPA, the config's window on every layer
    # the window cuts 48 tokens: a windowed kernel computes min(i + 1, window) keys for query i
    assert savings(phi3, SEQ) == [unseen(SEQ, WINDOW, 16)] * 2
    assert unseen(SEQ, WINDOW, 16) > causal_half(SEQ, 16)
    assert savings(phi3, WINDOW) == [causal_half(WINDOW, 16)] * 2  # it covers 16: the causal kernel
    llama = _shrunk(tmp_path, "llama3_8b.json")  # no window
    assert savings(llama, SEQ) == [causal_half(SEQ, 16)] * 2
    gemma2 = _shrunk(tmp_path, "gemma2_9b.json", head_dim=16, sliding_window=WINDOW, sliding_window_size=WINDOW)
    # sliding, then global: profiled as the fused kernel (eager attention would count all s x s scores)
    assert savings(gemma2, SEQ) == [unseen(SEQ, WINDOW, 16), causal_half(SEQ, 16)]


def test_attention_sinks_are_profiled_as_the_fused_kernel(tmp_path):
    """GPT-OSS (sinks: transformers runs it eagerly) keeps no s x s scores in its profile: its
    blocks' activations grow linearly with the sequence, and its sliding layers skip the entries
    outside the window as SDPA layers do (eager attention kept 4 fp32 score maps of s x s a layer)."""
    from meshplan.planner.models.hf_attention import FUSED_PROFILE_ATTENTION
    from meshplan.planner.profiling.profiler import profile
    from meshplan.planner.profiling.tracing import seen_entries

    pytest.importorskip("transformers")
    spec = _shrunk(tmp_path, "gpt_oss_20b.json", head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                   num_experts_per_tok=2, experts_per_token=2,
                   layer_types=["sliding_attention", "full_attention"])

    def blocks(seq: int):
        return [layer for layer in profile(spec, seq, dtype="fp32", cache=False).layers if layer.kind == "block"]
    short, double, triple = blocks(SEQ), blocks(2 * SEQ), blocks(3 * SEQ)
    assert profile(spec, SEQ, dtype="fp32", cache=False).info.attn_implementation == FUSED_PROFILE_ATTENTION
    for a, b, c in zip(short, double, triple):  # no s x s term: the second difference over s is zero
        assert c.act_tp_replicated_bytes - 2 * b.act_tp_replicated_bytes + a.act_tp_replicated_bytes == 0
    attention_fwd = 4 * SEQ * SEQ * 4 * 16  # QK^T and x V over 4 heads of 16
    assert [layer.fwd_flops - layer.causal_fwd_flops for layer in short] == [
        attention_fwd * (SEQ * SEQ - seen_entries(SEQ, WINDOW)) // (SEQ * SEQ),  # sliding, then full
        attention_fwd * (SEQ - 1) // (2 * SEQ)]
