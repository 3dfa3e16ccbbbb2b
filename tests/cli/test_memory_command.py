"""`meshplan memory`: model states across precisions, ZeRO stages and GPU counts, and one sample's
activations per sequence length, from the cost model's own rules."""
from __future__ import annotations

import json

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.activation_memory import activation_bytes
from meshplan.planner.costing.state_memory import paper_state_bytes
from meshplan.planner.profiling.profiler import profile


def test_the_table_in_json_matches_the_cost_models_rules(run_cli):
    code, out, err = run_cli("memory", "--model", "llama3-8b", "--json")
    assert code == 0, err
    data = json.loads(out)
    params = data["total_params"]
    assert params == profile("llama3-8b", 2048).total_params and 8.0e9 < params < 8.1e9
    rows = {(r["precision"], r["zero"], r["gpus"]): r for r in data["states"]}
    assert len(rows) == 2 * 4 * 3
    # The ZeRO paper's 16 bytes per parameter, and stage 3 over 64 GPUs: 16 / 64
    assert rows[("bf16-mixed", 0, 1)]["total"] == pytest.approx(16 * params)
    assert rows[("bf16-mixed", 3, 64)]["total"] == pytest.approx(16 * params / 64)
    assert rows[("bf16-mixed", 1, 8)]["optimizer"] == pytest.approx(12 * params / 8)
    assert rows[("fp32", 2, 8)] == {"precision": "fp32", "zero": 2, "gpus": 8,
                                    **paper_state_bytes(params, 8, 2, "fp32"),
                                    "total": pytest.approx(sum(paper_state_bytes(params, 8, 2, "fp32").values()))}
    seqs = sorted({r["seq"] for r in data["activations_per_sample"]})
    assert seqs == [1024, 2048, 4096, 8192]
    row = next(r for r in data["activations_per_sample"] if r["seq"] == 4096 and r["precision"] == "bf16-mixed")
    graph, config = profile("llama3-8b", 4096), ParallelConfig(gpus=1, global_batch=1)
    kept = [activation_bytes(layer, config, 1.0, recompute="full") for layer in graph.layers]
    assert row["activations"]["full"] == pytest.approx(sum(s for s, _ in kept) + max(t for _, t in kept))
    assert row["activations"]["full"] < row["activations"]["none"]


def test_the_printed_table_and_a_models_own_position_limit(run_cli):
    code, out, err = run_cli("memory", "--model", "gpt2")
    assert code == 0, err
    assert out.startswith("gpt2: 0.124 B parameters") and "zero" in out and "selective" in out
    seq_rows = [line.split()[1] for line in out.splitlines() if line.strip().startswith(("bf16-mixed", "fp32"))
                and len(line.split()) == 5]
    assert set(seq_rows) == {"1024"}  # GPT-2's 1024 learned positions cap the default lengths
    code, _, err = run_cli("memory", "--model", "gpt2", "--seq", 4096)
    assert code == 2 and "exceeds the 1024 learned positions" in err


def test_gpus_picks_the_state_rows_gpu_counts(run_cli):
    code, out, err = run_cli("memory", "--model", "llama3-8b", "--gpus", "512,16,16", "--json")
    assert code == 0, err
    data = json.loads(out)
    params = data["total_params"]
    assert sorted({r["gpus"] for r in data["states"]}) == [16, 512]  # deduplicated, ascending
    rows = {(r["precision"], r["zero"], r["gpus"]): r for r in data["states"]}
    assert rows[("bf16-mixed", 3, 512)]["total"] == pytest.approx(16 * params / 512)
    assert rows[("bf16-mixed", 1, 16)]["optimizer"] == pytest.approx(12 * params / 16)


@pytest.mark.parametrize("gpus, says", [("8,x", "comma-separated GPU counts"), ("0,8", "must be positive"),
                                        (",".join(map(str, range(1, 18))), "at most 16 GPU counts")])
def test_a_bad_gpus_list_is_a_usage_error(run_cli, gpus, says):
    code, _, err = run_cli("memory", "--model", "gpt2", "--gpus", gpus)
    assert code == 2 and says in err and "Traceback" not in err
