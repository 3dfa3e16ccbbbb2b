"""Bad Hugging Face input, refused early and in one line: misspelt keys, unknown model types,
--seq beyond the config's positions, and a config edited after planning."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}


def write(tmp_path, data: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def one_line_error(code: int, err: str) -> str:
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_misspelt_key_names_the_nearest_known_key(run_cli, tmp_path):
    data = {**LLAMA, "intermediate_sise": 128}
    del data["intermediate_size"]
    code, _, err = run_cli("profile", "--model", f"hf:{write(tmp_path, data)}", "--seq", 16, "--no-cache")
    assert "unknown key 'intermediate_sise', did you mean 'intermediate_size'?" in one_line_error(code, err)


def test_model_type_typo_lists_the_nearest_types_in_one_short_line(run_cli, tmp_path):
    code, _, err = run_cli("profile", "--model", f"hf:{write(tmp_path, {**LLAMA, 'model_type': 'lama'})}",
                           "--seq", 16, "--no-cache")
    err = one_line_error(code, err)
    assert "unknown model_type 'lama'; nearest known: llama" in err and len(err) < 400


def test_published_keys_transformers_ignores_are_noted_not_refused(run_cli, tmp_path):
    path = write(tmp_path, {**LLAMA, "topk_method": "noaux_tc"})
    code, out, _ = run_cli("profile", "--model", f"hf:{path}", "--seq", 16, "--no-cache", "--json")
    data = json.loads(out)
    assert code == 0 and data["attn_implementation"] == "sdpa"
    assert data["notes"] == ["config keys LlamaConfig does not read (ignored): topk_method"]


@pytest.mark.parametrize("command", ["profile", "estimate", "plan"])
def test_seq_beyond_the_config_positions_is_refused(run_cli, tmp_path, command):
    spec = f"hf:{write(tmp_path, LLAMA)}"
    job = ("--cluster", "cpu", "--gpus", 1, "--gbs", 2) if command != "profile" else ()
    code, _, err = run_cli(command, "--model", spec, "--seq", 128, *job)
    assert "sequence length 128 exceeds the 64 positions" in one_line_error(code, err)
    assert "max_position_embeddings" in err


def test_gpt2_explicit_seq_beyond_its_positions_is_refused(run_cli):
    for command, job in (("profile", ()), ("estimate", ("--cluster", "cpu", "--gpus", 1, "--gbs", 2))):
        code, _, err = run_cli(command, "--model", "gpt2", "--seq", 2048, *job)
        assert "exceeds the 1024 learned positions" in one_line_error(code, err)


def test_config_edited_after_planning_is_refused_by_train_and_warned_by_report(run_cli, tmp_path, no_launch):
    config = write(tmp_path, LLAMA)
    plan_path = tmp_path / "plan.json"
    code, _, err = run_cli("plan", "--model", f"hf:{config}", "--cluster", "cpu", "--gpus", 1, "--gbs", 2,
                           "--seq", 16, "--out", plan_path)
    assert code == 0, err
    assert len(json.loads(plan_path.read_text())["model"]["digest"]) == 64
    code, _, err = run_cli("train", "--plan", plan_path, "--nproc", 1, "--steps", 1, "--out", tmp_path / "m.json")
    assert "stopped at the launch" in err  # unchanged: train goes ahead
    write(tmp_path, {**LLAMA, "intermediate_size": 192})
    code, _, err = run_cli("train", "--plan", plan_path, "--nproc", 1, "--steps", 1, "--out", tmp_path / "m.json")
    assert "is not the one it was planned for" in one_line_error(code, err) and "re-plan" in err

    from meshplan.planner.contracts.plan import load_plan
    from meshplan.planner.models.plan_check import model_changed

    assert "changed since" in model_changed(load_plan(str(plan_path)))


def test_plans_without_a_digest_still_load_and_are_not_checked(tmp_path):
    from meshplan.planner.contracts.plan import load_plan
    from meshplan.planner.models.plan_check import model_changed
    from tests.report_fixtures import make_plan

    data = make_plan().to_json()
    assert "digest" not in data["model"]  # a plan written before digests: same JSON as then
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_plan(str(path)).model.digest == "" and model_changed(load_plan(str(path))) == ""
