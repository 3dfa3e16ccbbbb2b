"""The profiler against independent values: FLOP formulas, a term-by-term derivation of what
autograd saves in a GPT block, direct FlopCounterMode runs of arbitrary modules, HF models."""
from __future__ import annotations

import json
import textwrap

import pytest

from meshplan.planner.profiling.profiler import profile

GPT_SPEC = "gpt:layers=2,hidden=256,heads=4,vocab=1000"
SEQ, HIDDEN, HEADS = 128, 256, 4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))


def test_gpt_block_flops_match_megatron_formula():
    graph = profile(GPT_SPEC, SEQ, cache=False)
    block = graph.layer("blocks.0")
    s, h = SEQ, HIDDEN
    # Matmul FLOPs of one block per sample (Narayanan et al. 2021): QKV 6sh^2, QK^T 2s^2h,
    # attn*V 2s^2h, output 2sh^2, MLP 16sh^2. Attention counted in full (model-FLOPs convention).
    expected = 24 * s * h**2 + 4 * s**2 * h
    assert block.fwd_flops == pytest.approx(expected, rel=0.02)  # 2%: the acceptance tolerance
    # Backward: a grad-input and a grad-weight matmul per forward matmul.
    assert block.bwd_flops == pytest.approx(2 * block.fwd_flops, rel=0.02)
    # Causal kernels compute s(s+1)/2 of the s^2 score entries.
    assert block.causal_fwd_flops == block.fwd_flops - 4 * s**2 * h * (s - 1) // (2 * s)


def _gpt_block_saved_bytes(s: int, h: int, a: int, attention: str, p: int = 2) -> dict[str, int]:
    """What autograd saves in one GPT block of planner.models.registry.transformer, per sample, in bf16
    (p = 2 bytes), derived tensor by tensor (no dropout: the zoo has none).

    Replicated across TP ranks (outside the column->row region):
      LayerNorm 1 saves its input (p*sh) and fp32 mean and rstd (4s + 4s);
      the q, k and v Linears save their common input, LN1's output, once (p*sh);
      LayerNorm 2 the same (p*sh + 8s); the MLP up Linear saves LN2's output (p*sh).
    TP-sharded:
      flash: the fused kernel keeps q, k, v (3 p*sh), its output (p*sh) and an fp32 log-sum-exp
             per head and position (4as);
      math:  torch's math SDPA upcasts to fp32 and saves q*sqrt(scale), k^T*sqrt(scale) and v
             (3 * 4sh); the fp32 softmax (4as^2) is the score tensor (softmax backward and the
             attn @ v matmul share it);
      the o Linear's input, the heads-merged attention output: under flash a reference to the
      kernel's output (nothing more); under math, which does not keep its output, a copy (p*sh);
      GELU saves its input, the up output (p*4sh); the down Linear saves GELU's output (p*4sh).
    """
    replicated = 4 * p * s * h + 16 * s
    mlp = 2 * p * 4 * s * h
    if attention == "flash":
        return {"replicated": replicated, "sharded": 4 * p * s * h + 4 * a * s + mlp, "score": 0}
    return {"replicated": replicated, "sharded": 12 * s * h + p * s * h + mlp, "score": 4 * a * s * s}


@pytest.mark.parametrize("attention", ["flash", "math"])
def test_gpt_block_activation_bytes_match_derivation(attention):
    graph = profile(GPT_SPEC, SEQ, attention=attention, cache=False)
    block = graph.layer("blocks.0")
    s, h, a = SEQ, HIDDEN, HEADS
    derived = _gpt_block_saved_bytes(s, h, a, attention)
    # 5%: the acceptance tolerance (this torch version matches exactly).
    assert block.act_tp_replicated_bytes == pytest.approx(derived["replicated"], rel=0.05)
    assert block.act_tp_sharded_bytes == pytest.approx(derived["sharded"], rel=0.05)
    assert block.act_attn_score_bytes == pytest.approx(derived["score"], rel=0.05)
    assert block.activation_bytes == pytest.approx(sum(derived.values()), rel=0.05)

    # Korthikanti et al. 2022, eq. 1 with b = 1: sbh(34 + 5as/h) bytes (fp16, dropout p > 0).
    korthikanti = s * h * (34 + 5 * a * s / h)
    ours = sum(derived.values())
    if attention == "flash":
        # 32sh: Korthikanti's count (the attention output kept once, for the kernel and the o
        # Linear alike) less the two 1-byte dropout masks we do not have; the s x s term is gone
        # (the kernel recomputes scores in backward); fp32 LayerNorm statistics (16s) and the
        # log-sum-exp (4as) are extra and small.
        assert ours - korthikanti == -2 * s * h - 5 * a * s * s + 16 * s + 4 * a * s
    else:
        # +6sh: the math path keeps q, k, v in fp32 (12sh vs 6sh); -2sh: no dropout masks;
        # scores: one fp32 softmax (4as^2) instead of softmax (2as^2) + dropout mask (as^2) +
        # dropout output (2as^2); +16s fp32 LayerNorm statistics.
        assert ours - korthikanti == 6 * s * h - 2 * s * h + 4 * a * s * s - 5 * a * s * s + 16 * s


def _llama_block_saved_bytes_per_token(h: int, a: int, kv_heads: int, f: int, p: int = 2) -> dict[str, int]:
    """What autograd saves in one Llama block of planner.models.transformer per token, in bf16
    (p = 2 bytes) with flash attention, derived tensor by tensor (d = h/a head dim, d_kv =
    kv_heads * d, f the SwiGLU width; no dropout, no biases).

    Replicated across TP ranks (outside the column->row region):
      each of the two RMSNorms (one fused op) saves its input (p*h) and an fp32 rstd (4);
      the q, k and v Linears' common input, the attention norm's output, and the gate and up
      Linears' (the MLP norm's output) are references rebuilt in backward from the norms'
      inputs: nothing kept ("rebuilt": 2 p*h).
    TP-sharded:
      RoPE saves its cos and sin tables, (s, d/2) each in bf16 and shared by q and k (2 * p*d/2);
      the fused kernel keeps q (p*h), k and v at kv heads (2 p*d_kv: GQA, not expanded), its
      output (p*h) and an fp32 log-sum-exp per head (4a);
      the o Linear keeps a reference to that output (nothing more);
      the fused SwiGLU keeps its inputs, the gate and up outputs (2 p*f; silu is recomputed in
      backward); the down Linear saves the product (p*f).
    In all (p = 2): 8h + 4 d_kv + 6f + 4a + 2d + 8 kept, 4h rebuilt.
    """
    d = h // a
    replicated = 2 * (p * h + 4)
    sharded = p * d + 2 * p * h + 2 * p * kv_heads * d + 4 * a + 3 * p * f
    return {"replicated": replicated, "sharded": sharded, "score": 0, "rebuilt": 2 * p * h}


@pytest.mark.parametrize("spec,h,a,kv_heads,f", [
    ("llama:layers=1,hidden=256,heads=8,kv_heads=2,ffn=896,vocab=512", 256, 8, 2, 896),
    ("llama3-8b", 4096, 32, 8, 14336),
    ("llama3-405b", 16384, 128, 8, 53248),
])
def test_llama_block_activation_bytes_match_derivation(spec, h, a, kv_heads, f):
    s = 128
    block = profile(spec, s, dtype="bf16", attention="flash", cache=False).layer("blocks.0")
    derived = _llama_block_saved_bytes_per_token(h, a, kv_heads, f)
    # Exact: every saved tensor is accounted for (the fp32 norm copies and expanded K/V of the
    # old block would add 16h + 4(h - d_kv) + 2d per token).
    assert block.act_tp_replicated_bytes == s * derived["replicated"]
    assert block.act_tp_sharded_bytes == s * derived["sharded"]
    assert block.act_attn_score_bytes == 0
    assert block.act_rebuilt_bytes == s * derived["rebuilt"]

    # Against the GPT block at the same hidden size and heads (32h + 16 + 4a per token, see
    # _gpt_block_saved_bytes): the measured ratio is the derived one.
    gpt = profile(f"gpt:layers=1,hidden={h},heads={a},vocab=512", s, dtype="bf16", attention="flash",
                  cache=False).layer("blocks.0")
    gpt_per_token = sum(_gpt_block_saved_bytes(s, h, a, "flash").values()) // s
    assert gpt_per_token == 32 * h + 16 + 4 * a
    assert gpt.activation_bytes == s * gpt_per_token
    d_kv = kv_heads * (h // a)
    llama_per_token = 8 * h + 4 * d_kv + 6 * f + 4 * a + 2 * (h // a) + 8
    assert sum(derived.values()) - derived["rebuilt"] == llama_per_token
    assert block.activation_bytes / gpt.activation_bytes == pytest.approx(llama_per_token / gpt_per_token,
                                                                           rel=1e-12)


def test_llama_gqa_flops_count_attention_at_query_heads():
    """SDPA with enable_gqa: the model-FLOPs convention counts QK^T and attn @ V in full
    (non-causal) at the q heads, 4 s^2 h forward, as the expanded-K/V block did; backward twice."""
    s, h, kv_dim, ffn = 128, 256, 2 * 32, 896
    block = profile("llama:layers=1,hidden=256,heads=8,kv_heads=2,ffn=896,vocab=512", s,
                    cache=False).layer("blocks.0")
    matmuls = 4 * s * h * h + 4 * s * h * kv_dim + 6 * s * h * ffn
    assert block.fwd_flops == matmuls + 4 * s * s * h
    assert block.bwd_flops == 2 * block.fwd_flops
    assert block.causal_fwd_flops == block.fwd_flops - 4 * s * s * h * (s - 1) // (2 * s)


def test_head_holds_fp32_logits_and_tied_weight_is_owned_by_embedding():
    graph = profile(GPT_SPEC, SEQ, cache=False)
    embed, head = graph.layer("embed"), graph.layer("head")
    padded_vocab, h = graph.info.padded_vocab, HIDDEN
    # cross entropy in fp32 saves log-softmax of the logits: 4 bytes * s * V, vocab-sharded
    assert head.act_tp_sharded_bytes >= 4 * SEQ * padded_vocab
    assert head.shared_params == padded_vocab * h and head.num_params == 2 * h  # final LayerNorm only
    assert embed.num_params == (padded_vocab + SEQ) * h
    assert embed.tp_split.kind == head.tp_split.kind == "vocab" and head.tp_split.vocab_size == padded_vocab


def test_per_layer_params_sum_to_model_params_and_blocks_repeat():
    from meshplan.planner.models.registry import build_model

    graph = profile(GPT_SPEC, SEQ, cache=False)
    module = build_model(GPT_SPEC, SEQ).module
    assert graph.total_params == sum(p.numel() for p in module.parameters())
    assert [layer.name for layer in graph.layers] == ["embed", "blocks.0", "blocks.1", "head"]
    assert graph.layer("blocks.1").repeat_of == "blocks.0" and graph.layer("blocks.0").repeat_of is None
    assert graph.repeat_groups()[1] == ("blocks.0", [1, 2])
    split = graph.layer("blocks.0").tp_split
    assert split.kind == "block" and split.column_linears == ("attn.q", "attn.k", "attn.v", "mlp.up")
    assert split.row_linears == ("attn.o", "mlp.down") and split.num_heads == HEADS
    # Edges carry the boundary bytes: a (s, h) bf16 hidden state between blocks.
    assert graph.graph.edges["blocks.0", "blocks.1"]["bytes"] == 2 * SEQ * HIDDEN


def test_llama_block_flops_and_405b_total():
    graph = profile("llama:layers=2,hidden=256,heads=8,kv_heads=2,ffn=512,vocab=512", 64, cache=False)
    s, h, kv_dim, ffn = 64, 256, 2 * 32, 512
    # q and o: 2 * 2sh^2; k and v: 2 * 2sh*kv_dim; SwiGLU: 3 * 2sh*ffn; attention 4s^2h.
    expected = 4 * s * h * h + 4 * s * h * kv_dim + 6 * s * h * ffn + 4 * s * s * h
    assert graph.layer("blocks.0").fwd_flops == expected
    big = profile("llama3-405b", 256, cache=False)
    assert big.total_params == 405_853_388_800 and len(big.layers) == 128


def test_dtype_sets_bytes():
    bf16 = profile(GPT_SPEC, SEQ, dtype="bf16", cache=False).layer("blocks.0")
    fp32 = profile(GPT_SPEC, SEQ, dtype="fp32", cache=False).layer("blocks.0")
    assert fp32.param_bytes == 2 * bf16.param_bytes == 4 * bf16.num_params
    assert fp32.output_bytes == 2 * bf16.output_bytes
    # Everything but the fp32 LayerNorm statistics (16s) and log-sum-exp doubles.
    fixed = 16 * SEQ + 4 * HEADS * SEQ
    assert fp32.activation_bytes - fixed == 2 * (bf16.activation_bytes - fixed)


_CNN_FILE = '''
import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(32, 10)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def build():
    return SmallCNN(), torch.randn(1, 3, 32, 32)


def loss_fn(output, inputs):
    return output.float().logsumexp(-1).mean()
'''

_MIXER_FILE = '''
import torch
from torch import nn


class MixerBlock(nn.Module):
    def __init__(self, tokens, dim):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, dim=64, patch=4, image=32, depth=4, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*[MixerBlock((image // patch) ** 2, dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, img):
        x = self.stem(img).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(1))


def build():
    return Mixer(), (torch.randn(1, 3, 32, 32),)
'''


_MODULELIST_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, dim=32, depth=3):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())
                                    for _ in range(depth))
        self.out = nn.Linear(dim, 2)
        self.scale = nn.Parameter(torch.ones(dim))  # on the root: owned by the first layer

    def forward(self, x):
        h = self.inp(x) * self.scale
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def build():
    return Net(), torch.randn(1, 16, 8)
'''


def _direct_counts(path, fn_name):
    """FlopCounterMode and sum(numel) run directly on the module the file builds (CPU, fp32)."""
    import importlib.util

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    spec = importlib.util.spec_from_file_location("direct_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    module, inputs = getattr(mod, fn_name)()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    with FlopCounterMode(display=False) as fwd_counter:
        module(*inputs)
    with FlopCounterMode(display=False) as step_counter:
        out = module(*inputs)
        if hasattr(mod, "loss_fn"):
            mod.loss_fn(out, inputs).backward()
        else:
            out.backward(torch.ones_like(out))
    return fwd_counter.get_total_flops(), step_counter.get_total_flops(), sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("source,expected_names", [
    (_CNN_FILE, ["features.0", "features.1", "features.2", "features.3", "features.4", "features.5",
                 "features.6", "classifier"]),
    (_MIXER_FILE, ["stem", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]),
    (_MODULELIST_FILE, ["inp", "layers.0", "layers.1", "layers.2", "out"]),
])
def test_file_model_totals_equal_direct_flop_counter(tmp_path, source, expected_names):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(source))
    graph = profile(f"{path}:build", 32, dtype="fp32", cache=False)
    fwd, step, num_params = _direct_counts(path, "build")
    assert [layer.name for layer in graph.layers] == expected_names  # dominant child split up
    assert graph.fwd_flops == fwd and fwd > 0
    assert graph.fwd_flops + graph.bwd_flops == step
    assert graph.total_params == num_params
    assert all(layer.kind == "other" and layer.tp_split.kind == "none" for layer in graph.layers)


def test_file_model_repeated_blocks_are_marked(tmp_path):
    path = tmp_path / "mixer.py"
    path.write_text(textwrap.dedent(_MIXER_FILE))
    graph = profile(f"{path}:build", 32, cache=False)
    assert [layer.repeat_of for layer in graph.layers] == [None, None, "blocks.0", "blocks.0", "blocks.0", None, None]


def _write_hf_config(tmp_path, tied: bool):
    config = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500,
              "max_position_embeddings": 256, "tie_word_embeddings": tied}
    path = tmp_path / f"config_{int(tied)}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_hf_llama_config(tmp_path, tied):
    pytest.importorskip("transformers")
    import torch
    import transformers

    path = _write_hf_config(tmp_path, tied)
    graph = profile(f"hf:{path}", 64, cache=False)
    assert [layer.kind for layer in graph.layers] == ["embedding", "block", "block", "block", "head"]
    # Independent count: the whole transformers model built on the meta device.
    config = transformers.AutoConfig.for_model(**json.loads(path.read_text()))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    assert graph.layer("head").shared_params == (500 * 128 if tied else 0)
    # Same block as the zoo's Llama: identical matmul FLOPs (the formula test covers the zoo).
    zoo = profile("llama:layers=1,hidden=128,heads=4,kv_heads=2,ffn=256,vocab=512", 64, cache=False)
    assert graph.layer("blocks.2").fwd_flops == zoo.layer("blocks.0").fwd_flops
    assert graph.layer("blocks.2").repeat_of == "blocks.0"
    assert graph.layer("blocks.0").tp_split.num_kv_heads == 2
    # Flash attention: no score bytes; math: the fp32 softmax of 4 heads x 64 x 64.
    math = profile(f"hf:{path}", 64, attention="math", cache=False)
    assert graph.layer("blocks.0").act_attn_score_bytes == 0
    assert math.layer("blocks.0").act_attn_score_bytes == 4 * 4 * 64 * 64


def test_cache_round_trip_and_corrupt_entry(tmp_path):
    from meshplan.planner.profiling.profiler import _cache_path

    # Zoo specs are cached only when traced (their closed form needs no cache).
    first = profile(GPT_SPEC, 64, trace=True)
    path = _cache_path(GPT_SPEC, 64, "bf16", "flash")
    assert path.exists() and str(path).startswith(str(tmp_path / "cache"))
    assert profile(GPT_SPEC, 64, trace=True) == first  # served from the cache, equal field by field
    path.write_text("{not json")
    assert profile(GPT_SPEC, 64, trace=True) == first  # corrupt entry ignored ...
    assert json.loads(path.read_text())["graph"]["spec"] == GPT_SPEC  # ... and rewritten


def test_cache_key_follows_model_and_profiler_source(tmp_path, monkeypatch):
    """Zoo specs have no file of their own: the key hashes the model and profiling code, so an
    edit of the block (this module's files, not a stale list of old paths) is never answered
    with the graph cached before it."""
    import inspect
    import shutil
    from pathlib import Path

    import meshplan.planner.models.registry as registry
    import meshplan.planner.models.transformer as transformer
    import meshplan.planner.profiling.tracing as tracing
    from meshplan.planner.contracts import graph
    from meshplan.planner.profiling import profiler

    hashed = profiler._code_files()
    assert all(path.is_file() for path in hashed)
    for module in (transformer, registry, tracing, profiler, graph):
        assert Path(inspect.getsourcefile(module)).resolve() in {path.resolve() for path in hashed}

    root = Path(transformer.__file__).resolve().parent.parent
    copy = tmp_path / "planner"
    for path in hashed:
        target = copy / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    before = profiler._code_hash(copy)
    assert before == profiler._code_hash(root)  # names relative to the package, not absolute
    block = copy / "models" / "transformer.py"
    block.write_text(block.read_text().replace("enable_gqa=", "enable_gqa=False and "))
    assert profiler._code_hash(copy) != before

    key = profiler._cache_path(GPT_SPEC, 64, "bf16", "flash")
    monkeypatch.setattr(profiler, "_code_hash", lambda: "edited")
    assert profiler._cache_path(GPT_SPEC, 64, "bf16", "flash") != key


def test_file_spec_cache_follows_file_content(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(_CNN_FILE))
    before = profile(f"{path}:build", 32)
    path.write_text(textwrap.dedent(_CNN_FILE).replace("nn.Linear(32, 10)", "nn.Linear(32, 20)"))
    after = profile(f"{path}:build", 32)
    assert after.total_params == before.total_params + 10 * 33


def test_hf_gpt2_config_blocks_cannot_be_split(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                "vocab_size": 300, "n_positions": 128}))
    graph = profile(f"hf:{path}", 32, cache=False)
    block = graph.layer("blocks.0")
    # GPT-2's fused c_attn Conv1D is not a q/k/v Linear triple: not split, nothing TP-sharded.
    assert block.tp_split.kind == "none" and block.act_tp_sharded_bytes == 0
    assert block.act_tp_replicated_bytes > 0
    # wpe is outside every group: it goes to the first layer; the tied head owns no weight.
    assert graph.layer("embed").num_params == (300 + 128) * 64
    assert graph.layer("head").shared_params == 300 * 64
