"""The model zoo: published parameter counts, Megatron's GPT formula, spec parsing and errors."""
from __future__ import annotations

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


def test_importing_the_zoo_specs_does_not_import_torch():
    code = "import sys, planner.models.registry as m; m.parse_spec('llama3-8b', 8); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_presets_have_published_shapes():
    cfg = PRESETS["llama3-405b"]
    assert (cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.ffn_dim) == (126, 16384, 128, 8, 53248)
