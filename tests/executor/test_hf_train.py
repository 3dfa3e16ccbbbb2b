"""Hugging Face causal LMs (`hf:config.json`) plan inside the executor's space and train.

Data parallelism (pinned with --dp 2: the planner may also pipeline HF models, which
test_hf_parallel.py covers): DDP (ZeRO-0), and FSDP2 with each decoder layer its own unit
(ZeRO-3; a tied embedding and head stay with the root). The reference is a single-process
loop written here from the rules the executor documents: weights from `torch.manual_seed(seed)`
before transformers builds the model from its config, the zoo's token batches, the next-token
loss, clipping to a global norm of 1, AdamW and the warm-up + cosine schedule.

Tolerance: 1e-5 relative on every loss. All fp32 on CPU; the layouts differ from the reference
only in summation order (micro-batch means, all-reduce vs one backward), a few 1e-7 per step.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

SEQ, GBS, STEPS, LR = 16, 4, 4, 2e-3


def _config(tmp_path, tied: bool) -> str:
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
              "max_position_embeddings": 64, "tie_word_embeddings": tied}
    path = tmp_path / f"llama_{int(tied)}.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def _reference_losses(spec: str, seed: int) -> list[float]:
    from tests.process_helpers import hf_reference_losses

    return hf_reference_losses(spec, SEQ, GBS, STEPS, LR, seed)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_hf_llama_trains_with_ddp_and_fsdp_like_one_process(run_cli, tmp_path):
    from meshplan.executor.launch import launch_jobs
    from meshplan.planner.contracts.plan import load_plan

    cases = {"ddp": (False, 0), "zero3": (False, 3), "tied-zero2": (True, 2)}
    jobs, plans = [], {}
    for name, (tied, zero) in cases.items():
        spec, out = _config(tmp_path, tied), tmp_path / f"{name}.json"
        code, _, err = run_cli("plan", "--model", spec, "--cluster", "cpu", "--gpus", 2, "--gbs", GBS,
                               "--seq", SEQ, "--zero", zero, "--mbs", 1, "--dp", 2, "--out", out)
        assert code == 0, err
        plans[name] = load_plan(out)
        cfg = plans[name].config
        assert (cfg.pp, cfg.tp, cfg.dp, cfg.zero, cfg.num_microbatches) == (1, 1, 2, zero, 2)
        jobs.append({"plan_path": str(out), "steps": STEPS, "lr": LR, "out": str(tmp_path / f"{name}.measured.json"),
                     "measure_memory": False})
    launch_jobs(jobs, 2, tmp_path / "run", timeout_s=350)
    failures = []
    for name, (tied, _) in cases.items():
        got = json.loads((tmp_path / f"{name}.measured.json").read_text())["losses"]
        expected = _reference_losses(plans[name].model.spec, plans[name].seed)
        assert len(got) == STEPS and got[-1] != got[0]  # every step ran, and the weights did change
        if got != pytest.approx(expected, rel=1e-5):
            failures.append(f"{name}: {got} vs single-process {expected}")
    assert not failures, "\n".join(failures)
