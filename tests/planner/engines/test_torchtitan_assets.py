"""A torchtitan job whose model flavour is no meshplan preset: its `hf_assets_path` (0.2's [model]
key, 0.3's Trainer.Config field) holds the Hugging Face config.json of the checkpoint it loads,
which meshplan then prices, saying so; without one the note asks for --model."""
from __future__ import annotations

import json

import pytest

from meshplan.planner.engines.torchtitan import read_torchtitan

QWEN3_1_7B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2048,
              "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000}


def _toml(assets: str) -> str:
    return (f'[model]\nname = "qwen3"\nflavor = "1.7B"\nhf_assets_path = "{assets}"\n'
            "[training]\nlocal_batch_size = 2\nseq_len = 4096\n[parallelism]\ndata_parallel_shard_degree = 8\n")


def _python(assets: str) -> str:
    return ("from torchtitan.config import ParallelismConfig, TrainingConfig\n"
            "from torchtitan.models.qwen3 import model_registry\nfrom torchtitan.trainer import Trainer\n\n\n"
            "def job():\n    return Trainer.Config(\n        model_spec=model_registry('1.7B'),\n"
            f"        hf_assets_path={assets!r},\n"
            "        training=TrainingConfig(local_batch_size=2, seq_len=4096),\n"
            "        parallelism=ParallelismConfig(data_parallel_shard_degree=8),\n    )\n")


@pytest.mark.parametrize("write", [_toml, _python], ids=["toml", "python"])
def test_an_unknown_flavour_is_priced_from_its_hf_assets_config(tmp_path, monkeypatch, write):
    monkeypatch.chdir(tmp_path)  # torchtitan resolves the path from where it runs
    (tmp_path / "assets" / "Qwen3-1.7B").mkdir(parents=True)
    (tmp_path / "assets" / "Qwen3-1.7B" / "config.json").write_text(json.dumps(QWEN3_1_7B))
    job = read_torchtitan(write("./assets/Qwen3-1.7B"))
    assert job.model == "hf:assets/Qwen3-1.7B/config.json"
    assert any("priced from assets/Qwen3-1.7B/config.json" in note for note in job.notes), job.notes
    missing = read_torchtitan(write("./assets/elsewhere"))
    assert missing.model is None
    assert any("hf_assets_path ./assets/elsewhere has no config.json here" in note and "pass --model" in note
               for note in missing.notes), missing.notes
