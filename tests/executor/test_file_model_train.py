"""File models (`path/model.py:fn` with a `loss_fn`) plan inside the executor's space and train.

The two-process run is compared with a single-process reference written here from the rules
the executor documents: weights from `torch.manual_seed(plan seed)` before `fn()`, step k's
global batch drawn from a generator seeded `seed * 1_000_003 + k`, the loss of a step the mean of
the micro-batch losses over all samples, clipping to a global norm of 1, AdamW and the LR schedule.
"""
from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

MODEL = '''
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build():
    return MLP(), torch.randn(1, 8)
'''
LOSS = '''

def loss_fn(output, inputs):
    return ((output - inputs[0][:, :4]) ** 2).mean()
'''
GBS, STEPS = 4, 4


def _write_model(tmp_path, with_loss: bool = True) -> str:
    path = tmp_path / ("mlp.py" if with_loss else "mlp_noloss.py")
    path.write_text(MODEL + (LOSS if with_loss else ""))
    return f"{path}:build"


def _plan(run_cli, tmp_path, spec: str):
    from meshplan.planner.contracts.plan import load_plan

    out = tmp_path / "plan.json"
    # mbs 1: each replica accumulates 2 micro-batches, so accumulation is part of what is compared.
    code, _, err = run_cli("plan", "--model", spec, "--cluster", "cpu", "--gpus", 2, "--gbs", GBS, "--seq", 1,
                           "--zero", 0, "--mbs", 1, "--out", out)
    assert code == 0, err
    return out, load_plan(out)


def _reference_losses(model_path, seed: int) -> list[float]:
    """Single-process training on the whole global batch (one sample per micro-batch)."""
    import torch

    from meshplan.executor.runtime import Hyperparameters, lr_at

    loaded = importlib.util.spec_from_file_location("reference_mlp", model_path)
    namespace = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(namespace)
    torch.manual_seed(seed)
    model, _ = namespace.build()
    hp = Hyperparameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                  weight_decay=hp.weight_decay)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        batch = torch.randn((GBS, 8), generator=generator)
        optimizer.zero_grad()
        per_sample = [namespace.loss_fn(model(batch[i:i + 1]), (batch[i:i + 1],)) for i in range(GBS)]
        loss = torch.stack(per_sample).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, STEPS, hp)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.timeout(200)
def test_dp2_zero0_matches_single_process(run_cli, tmp_path):
    spec = _write_model(tmp_path)
    plan_path, plan = _plan(run_cli, tmp_path, spec)
    cfg = plan.config
    assert (cfg.pp, cfg.tp, cfg.dp, cfg.zero, cfg.num_microbatches) == (1, 1, 2, 0, 2)
    out = tmp_path / "measured.json"
    code, _, err = run_cli("train", "--plan", plan_path, "--steps", STEPS, "--out", out)
    assert code == 0, err
    measured = json.loads(out.read_text())["losses"]
    expected = _reference_losses(spec.rpartition(":")[0], plan.seed)
    assert len(measured) == STEPS
    # fp32 both ways; only the order of the gradient sums differs (all-reduce vs one backward),
    # which moves the losses by a few ulps, far inside 1e-5 relative.
    assert measured == pytest.approx(expected, rel=1e-5)
    assert measured[-1] != measured[0]  # the weights did change


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_killed_file_model_run_resumes_from_its_checkpoint(run_cli, tmp_path, monkeypatch):
    """Rank 1 dies inside the save of step_4 (after its shards, before COMPLETE); torchrun
    restarts the workers, which load step_2 (model, optimizer, RNG, data position, losses) and
    finish: the losses of all 4 steps equal the single-process reference."""
    from meshplan.executor import train

    spec = _write_model(tmp_path)
    plan_path, plan = _plan(run_cli, tmp_path, spec)
    monkeypatch.setenv("MESHPLAN_FAULT", "kill_in_save:rank=1,step=4")
    resumed = train(plan_path, steps=STEPS, out=tmp_path / "m.json", run_dir=tmp_path / "run",
                    checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, max_restarts=1)
    assert resumed.resumed_from_step == 2
    assert sorted(p.parent.name for p in (tmp_path / "ckpt").glob("step_*/COMPLETE")) == ["step_2", "step_4"]
    # as in the uninterrupted comparison: only the order of the gradient sums differs
    assert resumed.losses == pytest.approx(_reference_losses(spec.rpartition(":")[0], plan.seed), rel=1e-5)


def test_default_search_stays_at_pp1_tp1(tmp_path):
    from meshplan.planner.search.candidates import Pins, enumerate_candidates
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.profiling.profiler import profile

    spec = _write_model(tmp_path)
    graph = profile(spec, 1, batch=1, dtype="fp32")
    # 8 GPUs and 2 layers would allow pp=2 and tp in {2, 4, 8} for a zoo-like graph.
    candidates = enumerate_candidates(graph, load_cluster("cpu"), 8, 8, Pins())
    assert candidates and {(c.pp, c.tp) for c in candidates} == {(1, 1)}


def test_pp_pin_refused(run_cli, tmp_path):
    spec = _write_model(tmp_path)
    code, _, err = run_cli("plan", "--model", spec, "--cluster", "cpu", "--gpus", 2, "--gbs", GBS, "--seq", 1,
                           "--pp", 2)
    assert code == 2
    assert "--pp 2" in err and "data parallelism only" in err


def test_train_refuses_without_loss_fn_and_with_pp(run_cli, tmp_path):
    from meshplan.executor.checks import check_file_plan
    from meshplan.executor.checks import check_plan_runnable
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.models.registry import build_model

    spec = _write_model(tmp_path)
    _, plan = _plan(run_cli, tmp_path, spec)
    path = spec.rpartition(":")[0]
    # A pp=2 layout (as a hand-edited plan would carry) is refused before any process starts.
    piped = SimpleNamespace(config=SimpleNamespace(pp=2, tp=1, ep=1), model=plan.model)
    with pytest.raises(MeshplanError, match="data parallelism only, this plan has pp=2 tp=1"):
        check_file_plan(piped, build_model(spec, 1, device="meta"))
    # The file lost its loss function: the old plan no longer matches the file (its digest), and
    # a plan made from the new file is refused for the missing loss.
    (tmp_path / "mlp.py").write_text(MODEL)
    with pytest.raises(MeshplanError, match="is not the one it was planned for"):
        check_plan_runnable(plan, 2)
    _, replanned = _plan(run_cli, tmp_path, spec)
    with pytest.raises(MeshplanError, match=f"define loss_fn\\(output, inputs\\) in {path} to train it"):
        check_plan_runnable(replanned, 2)
