"""The model zoo: published parameter counts, Megatron's GPT formula, spec parsing and errors."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.models.registry import PRESETS, build_for_profile, build_model, default_seq, parse_spec

# Published parameter counts (Touvron et al. 2023 / Meta's model cards and params.json; the
# Llama 3 numbers are the safetensors totals of the released checkpoints).
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


def _num_params(module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied weight once


def gpt_formula(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """Megatron-LM's 12lh^2 (1 + 13/(12h) + (V + s)/(12lh)) plus the final LayerNorm's 2h."""
    return 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq) * hidden + 2 * hidden


@pytest.mark.parametrize("name", ["llama2-7b", "llama3-8b"])
def test_llama_presets_built_whole_match_published(name):
    built = build_model(name, 128)
    assert _num_params(built.module) == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_llama_presets_one_block_times_layers_match_published(name):
    # The profiler builds one block: embed + layers * block + head must give the published total.
    target = build_for_profile(name, 128)
    groups = {g.name: g for g in target.built.layer_groups}
    block = _num_params(groups["blocks.0"].modules[0])
    total = _num_params(groups["embed"].modules[0]) + target.built.info.num_layers * block \
        + _num_params(groups["head"].modules[0])
    assert total == PUBLISHED_PARAMS[name]
    assert len(target.layout) == target.built.info.num_layers + 2


def test_gpt2_small_matches_megatron_formula_with_padded_vocab():
    built = build_model("gpt2", 1024)
    padded = built.info.padded_vocab
    assert padded == 50304  # 50257 padded to a multiple of 128
    assert _num_params(built.module) == gpt_formula(12, 768, padded, 1024)
    # The published 124,439,808 is the same formula with the unpadded vocabulary.
    assert gpt_formula(12, 768, 50257, 1024) == 124_439_808
    assert _num_params(built.module) - 124_439_808 == (padded - 50257) * 768


@pytest.mark.parametrize("spec,seq", [("gpt:layers=3,hidden=96,heads=4,vocab=1000", 64),
                                      ("gpt:layers=2,hidden=64,heads=2,vocab=129", 32),
                                      ("gpt2-medium", 1024)])
def test_parametric_gpt_matches_formula(spec, seq):
    built = build_model(spec, seq)
    cfg = built.config
    assert _num_params(built.module) == gpt_formula(cfg.num_layers, cfg.hidden, built.info.padded_vocab, seq)


def test_vocab_padding_scales_with_tp():
    cfg = parse_spec("gpt2", 1024)
    assert cfg.padded_vocab(1) == 50304 and cfg.padded_vocab(8) == 51200  # multiple of 128 * t


def test_gpt_with_grouped_query_attention_has_narrower_k_and_v():
    """`kv_heads` on a GPT spec (Nemotron-4's plain MLP with grouped-query attention): each block's
    k and v project to kv_heads x head_dim with their biases, 2 (h - kv h/heads)(h + 1) parameters
    fewer a block than multi-head attention; the graph's TP split names the KV heads."""
    mha = build_model("gpt:layers=2,hidden=64,heads=8,vocab=256", 16)
    gqa = build_model("gpt:layers=2,hidden=64,heads=8,kv_heads=2,vocab=256", 16)
    kv_width = 2 * 64 // 8
    assert _num_params(mha.module) - _num_params(gqa.module) == 2 * 2 * (64 - kv_width) * (64 + 1)
    assert gqa.config.kv_heads == 2


def test_untied_gpt_has_separate_head():
    tied = _num_params(build_model("gpt:layers=1,hidden=64,heads=2,vocab=256", 16).module)
    untied = _num_params(build_model("gpt:layers=1,hidden=64,heads=2,vocab=256,tied=0", 16).module)
    assert untied - tied == 256 * 64


def test_default_seq_is_capped_by_learned_positions():
    assert default_seq("gpt2") == 1024
    assert default_seq("llama3-8b") == 2048
    assert default_seq("gpt:layers=1,hidden=64,heads=2,vocab=256") == 2048


def test_gpt_preset_rejects_seq_beyond_positions():
    with pytest.raises(MeshplanError, match="exceeds the 1024 learned positions"):
        build_model("gpt2", 2048)


@pytest.mark.parametrize("spec,match", [
    ("nope", "known models: gpt2"),
    ("gpt:layers=2,hidden=64", "missing heads, vocab"),
    ("gpt:layers=2,hidden=64,heads=2,vocab=256,bogus=1", "unknown key 'bogus'"),
    ("llama:layers=x,hidden=64,heads=2,vocab=256", "malformed model spec"),
    ("missing_file.py:fn", "not found"),
    ("model.py", "expected path/model.py:function_name"),
])
def test_bad_specs_raise_meshplan_error(spec, match):
    with pytest.raises(MeshplanError, match=match):
        build_model(spec, 64)


@pytest.mark.parametrize("spec, meant", [
    ("Llama3_8B", "llama3-8b"), ("gpt-2", "gpt2"), ("llama3", "llama3-405b, llama3-70b or llama3-8b"),
    ("mixtral", "mixtral-8x22b or mixtral-8x7b"), ("meta-llama/Llama-3.1-8B", "hf:meta-llama/Llama-3.1-8B"),
])
def test_a_mistyped_model_is_answered_with_what_it_likely_means(spec, meant):
    with pytest.raises(MeshplanError, match=rf"unknown model '{re.escape(spec)}' \(did you mean {re.escape(meant)}[,?]"):
        build_model(spec, 64)


def test_importing_the_zoo_specs_does_not_import_torch():
    code = "import sys, planner.models.registry as m; m.parse_spec('llama3-8b', 8); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_presets_have_published_shapes():
    cfg = PRESETS["llama3-405b"]
    assert (cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.ffn_dim) == (126, 16384, 128, 8, 53248)


# ---------------------------------------------------------------------------------------------
# The Llama block as engines run it (GQA inside SDPA, fused RMSNorm, RoPE in the compute dtype)
# against the formulation it replaced.

SMALL_LLAMA = dict(family="llama", num_layers=1, hidden=128, num_heads=8, vocab=256, ffn=352, num_kv_heads=2)


def _old_block_forward(block, x):
    """The block as written before (the reference): RMSNorm and RoPE computed in fp32 (`x.float()`)
    and cast back, K and V expanded to all heads with `repeat_interleave` before SDPA. The MLP is
    unchanged and is called as is."""
    import torch
    import torch.nn.functional as F

    def rms_norm(norm, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
        return normed.type_as(x) * norm.weight

    def rope(x, cos, sin):
        x_even, x_odd = x.float()[..., 0::2], x.float()[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2).type_as(x)

    def attention(attn, x):
        batch, seq, _ = x.shape
        dim = attn.head_dim
        q = attn.q(x).view(batch, seq, -1, dim).transpose(1, 2)
        k = attn.k(x).view(batch, seq, -1, dim).transpose(1, 2)
        v = attn.v(x).view(batch, seq, -1, dim).transpose(1, 2)
        inv_freq = 1.0 / (attn.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        q, k = rope(q, angles.cos(), angles.sin()), rope(k, angles.cos(), angles.sin())
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn.o(out.transpose(1, 2).reshape(batch, seq, -1))

    x = x + attention(block.attn, rms_norm(block.attn_norm, x))
    return x + block.mlp(rms_norm(block.mlp_norm, x))


def _outputs_and_grads(forward, dtype):
    """Block output and the gradients of (x, every parameter) for one fixed block, input and
    upstream gradient (drawn in fp32 from a fixed seed, then cast to `dtype`)."""
    import torch

    from meshplan.planner.models.transformer import Block, TransformerConfig

    generator = torch.Generator().manual_seed(0)
    block = Block(TransformerConfig(**SMALL_LLAMA))
    with torch.no_grad():
        for name, param in block.named_parameters():  # norm weights away from 1: their gradient matters
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    x = torch.randn(2, 64, SMALL_LLAMA["hidden"], generator=generator)
    upstream = torch.randn(x.shape, generator=generator)
    block = block.to(dtype)
    x = x.to(dtype).requires_grad_()
    out = forward(block, x)
    grads = torch.autograd.grad(out, [x, *block.parameters()], upstream.to(dtype))
    names = ["output", "grad x"] + [f"grad {name}" for name, _ in block.named_parameters()]
    return dict(zip(names, [out.detach(), *grads]))


def _rel_error(got, want) -> float:
    """Norm-wise relative error (in float64)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def test_llama_block_fp32_equals_old_formulation():
    """fp32: the fused RMSNorm's forward and RoPE are the old ops (the casts are no-ops), so the
    output can differ only by SDPA summing over a KV group without the expanded copies; the
    gradients differ in summation order (RMSNorm's analytic fp32 backward instead of autograd's
    chain; the kernel's sum over each KV group instead of repeat_interleave's backward). Measured:
    output bitwise equal, gradients within 3e-7 relative. 1e-5 (with an absolute floor of 1e-5 of
    each tensor's largest entry, for gradient entries that cancel to ~0) is 30x that and far below
    what a wrong formula gives (a wrong RMSNorm gradient or a mis-grouped KV head is O(1))."""
    import torch

    new = _outputs_and_grads(lambda block, x: block(x), torch.float32)
    old = _outputs_and_grads(_old_block_forward, torch.float32)
    assert new.keys() == old.keys() and len(new) == 2 + 9  # 2 norms, q k v o, gate up down
    for name, want in old.items():
        torch.testing.assert_close(new[name], want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=name)


def test_llama_block_bf16_close_to_old_formulation_and_as_accurate():
    """bf16 keeps 8 significant bits, so each rounding moves a value by up to 2^-9 = 2e-3
    relative. The two formulations round at different points: RoPE rounds after each of its
    three bf16 ops (before: once, from fp32) and its tables are bf16; the fused RMSNorm's
    backward runs in fp32 where autograd's chain rounded to bf16 in between. Measured norm-wise
    relative differences: <= 8e-3 (a few roundings); tolerance 2e-2. Closeness alone would
    allow the new block to be worse, so both are also compared with float64 (the old
    formulation, exact up to 1e-16): the new block's error is measured within 3% of the old
    one's (tolerance: 25% more)."""
    import torch

    new = _outputs_and_grads(lambda block, x: block(x), torch.bfloat16)
    old = _outputs_and_grads(_old_block_forward, torch.bfloat16)
    exact = _outputs_and_grads(_old_block_forward, torch.float64)
    for name, want in old.items():
        assert new[name].dtype == torch.bfloat16, name
        assert _rel_error(new[name], want) <= 2e-2, name
        assert _rel_error(new[name], exact[name]) <= 1.25 * _rel_error(want, exact[name]), name


def test_rms_norm_forward_is_the_fp32_formula_and_saves_input_and_rstd():
    """The fused RMSNorm's output is bitwise the plain-ops formula's in bf16 and fp32; autograd
    keeps the bf16 input itself and one fp32 rstd per row (no fp32 copy of x)."""
    import torch

    from meshplan.planner.models.transformer import RMSNorm

    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(64, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=generator))
        x = torch.randn(3, 5, 64, generator=generator).to(dtype).requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = norm(x)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.equal(out, (x.float() * rstd).type_as(x) * norm.weight)
        assert saved[0] is x and saved[2] is norm.weight
        assert saved[1].shape == (3, 5, 1) and saved[1].dtype == torch.float32 and len(saved) == 3


def test_attention_keeps_its_output_once_with_the_same_gradients():
    """On CPU the flash kernel writes heads-major output, so merging heads for the o Linear is a
    copy: with the reference (the default) autograd keeps s x h x 4 bytes less per sample, and the
    gradients are bitwise those of keeping the copy (the same ops, the copy rebuilt in backward)."""
    import torch

    from meshplan.planner.models.transformer import Attention, TransformerConfig

    cfg = TransformerConfig("llama", 1, 64, 4, 256, num_kv_heads=2)
    torch.manual_seed(3)
    attention = Attention(cfg)
    x = torch.randn(2, 16, 64, requires_grad=True)

    def run(by_reference: bool):
        from torch.distributed._tools.mem_tracker import MemTracker

        attention.merged_heads_by_reference = by_reference
        tensors = [x, *attention.parameters()]
        for tensor in tensors:
            tensor.grad = None
        tracker = MemTracker()  # live tensor bytes, what the executor's memory figure counts
        with tracker:
            kept = attention(x)
            live_bytes = tracker.get_tracker_snapshot("current")[x.device]["Total"]
        del kept
        attention(x).square().sum().backward()
        grads = [tensor.grad.clone() for tensor in tensors]
        return live_bytes, grads

    try:
        kept_bytes, kept_grads = run(False)
        reference_bytes, reference_grads = run(True)
    finally:
        del attention.merged_heads_by_reference
    assert kept_bytes - reference_bytes == 2 * 16 * 64 * 4
    assert all(torch.equal(a, b) for a, b in zip(kept_grads, reference_grads))


def test_gqa_attention_sharded_by_heads_like_tensor_parallelism():
    """tp=2 as ColwiseParallel/RowwiseParallel shard it: each rank keeps a contiguous half of
    the q heads and of the KV heads (q/k/v rows, o columns), infers its local heads (2 q heads
    per KV head here, as unsharded) from the projection widths, and the row-parallel o outputs
    sum to the unsharded attention's output."""
    import torch
    from torch import nn

    from meshplan.planner.models.transformer import Attention, TransformerConfig

    cfg = TransformerConfig("llama", 1, 64, 4, 256, num_kv_heads=2)
    tp, dim = 2, cfg.head_dim
    generator = torch.Generator().manual_seed(2)
    full = Attention(cfg)
    with torch.no_grad():
        for param in full.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    x = torch.randn(2, 16, cfg.hidden, generator=generator)

    def linear(weight):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        layer.weight = nn.Parameter(weight.clone())
        return layer

    total = torch.zeros_like(x)
    for rank in range(tp):
        local = Attention(cfg)
        q_rows = slice(rank * cfg.num_heads * dim // tp, (rank + 1) * cfg.num_heads * dim // tp)
        kv_rows = slice(rank * cfg.kv_heads * dim // tp, (rank + 1) * cfg.kv_heads * dim // tp)
        local.q, local.o = linear(full.q.weight[q_rows]), linear(full.o.weight[:, q_rows])
        local.k, local.v = linear(full.k.weight[kv_rows]), linear(full.v.weight[kv_rows])
        out = local(x)
        assert out.shape == x.shape
        total += out
    torch.testing.assert_close(total, full(x), rtol=1e-5, atol=1e-6)


def test_fused_swiglu_matches_plain_ops_and_its_gradients():
    """The fused SwiGLU's forward is silu(g) * u exactly; its hand-written backward passes
    gradcheck in float64 (finite differences, torch's default tolerances)."""
    import torch
    import torch.nn.functional as F
    from meshplan.planner.models.transformer import _FusedSwiGLU

    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(3, 5, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    up = torch.randn(3, 5, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.equal(_FusedSwiGLU.apply(gate, up), F.silu(gate) * up)
    assert torch.autograd.gradcheck(_FusedSwiGLU.apply, (gate, up))
