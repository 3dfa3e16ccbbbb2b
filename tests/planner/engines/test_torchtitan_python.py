"""The exported Python config (`export --format python`) loaded by torchtitan 0.3.0's own config
machinery: `ConfigManager._load_config` imports the module by its path and calls the config function,
which builds 0.3's ParallelismConfig, TrainingConfig, activation checkpoint policy and model spec.

torchtitan 0.3.0 lives in `.venv/torchtitan-0.3` (the Makefile installs it there without its
dependencies, beside 0.2.2), so one subprocess with that folder first on sys.path runs all plans."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.planner.engines.bridge import export_plan
from tests.planner.engines.helpers import make_plan
from tests.planner.engines.test_engine_axes import PLANS

TITAN_03 = Path(sys.prefix) / "torchtitan-0.3"

# Runs in torchtitan 0.3.0. Two parts of 0.3 cannot load on a CPU machine and are replaced, nothing else:
# - torchtitan.distributed.minimal_async_ep.kernels: CUDA Triton kernels of the expert all-to-all that its
#   models package imports (triton is not installed with CPU torch); config building never launches them;
# - torchtitan.trainer: imports the training stack (torchdata, datasets, tensorboard, wandb). Its
#   Trainer.Config stand-in has the real class's types for the fields the export writes, and the
#   script checks those names against the real class's source.
LOADER = r'''
import ast, dataclasses, importlib.util, json, pathlib, sys, types
from dataclasses import dataclass, field

if importlib.util.find_spec("triton") is None:
    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
    kernels.__dict__.update(dict.fromkeys([
        "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
        "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
        "reduce_topk_slots_kernel", "topk_scores_grad_kernel"]))
    sys.modules[kernels.__name__] = kernels
import torchtitan
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.manager import ConfigManager
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.models.llama3 import llama3_configs

trainer_source = pathlib.Path(torchtitan.__file__).with_name("trainer.py").read_text()
trainer_cls = next(n for n in ast.parse(trainer_source).body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
config_cls = next(n for n in trainer_cls.body if isinstance(n, ast.ClassDef) and n.name == "Config")
trainer_fields = [n.target.id for n in config_cls.body if isinstance(n, ast.AnnAssign)]

@dataclass(kw_only=True, slots=True)
class Config:
    model_spec: object = None
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointingConfig = None

trainer = types.ModuleType("torchtitan.trainer")
trainer.Trainer = types.SimpleNamespace(Config=Config)
sys.modules["torchtitan.trainer"] = trainer
# meshplan's small test models are no torchtitan flavour: the export names them "custom"
llama3_configs.setdefault("custom", llama3_configs["debugmodel"])

folder = pathlib.Path(sys.argv[1])
sys.path.insert(0, str(folder))
out = {"version": torchtitan.__version__ if hasattr(torchtitan, "__version__") else None,
       "trainer_fields": trainer_fields, "jobs": {}}
for path in sorted(folder.glob("*.py")):
    try:
        job, rest = ConfigManager()._load_config(["--module", path.stem, "--config", "meshplan_job"])
    except (ImportError, ValueError) as exc:
        out["jobs"][path.stem] = {"error": str(exc)}
        continue
    ac = job.activation_checkpoint
    out["jobs"][path.stem] = {
        "parallelism": dataclasses.asdict(job.parallelism), "training": dataclasses.asdict(job.training),
        "activation_checkpoint": None if ac is None else type(ac).__qualname__,
        "model": [job.model_spec.name, job.model_spec.flavor], "rest": rest}
print(json.dumps(out))
'''

CASES = {**{name: make_plan(**config) for name, config in PLANS.items()},
         "selective": make_plan(pp=1, dp=4, zero=1, recompute="selective"),
         "full": make_plan(pp=1, dp=4, zero=1, recompute="full")}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    if not (TITAN_03 / "torchtitan").is_dir():
        pytest.skip(f"torchtitan 0.3.0 is not in {TITAN_03} (`make install` puts it there)")
    folder = tmp_path_factory.mktemp("jobs")
    base = make_plan(zero=1, pp=1, dp=4, sp=False)
    plans = {**CASES, "fp8": replace(base, config=replace(base.config, precision="fp8"))}
    for name, plan in plans.items():
        (folder / f"meshplan_job_{name}.py").write_text(export_plan(plan, "torchtitan", "python").text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TITAN_03), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", LOADER, str(folder)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_trainer_config_has_the_fields_the_export_writes(loaded):
    assert {"model_spec", "training", "parallelism", "activation_checkpoint"} <= set(loaded["trainer_fields"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_torchtitan_03_loads_the_exported_config(loaded, name):
    plan = CASES[name]
    job = loaded["jobs"][f"meshplan_job_{name}"]
    toml = tomllib.loads(export_plan(plan, "torchtitan").text)
    par, cfg = job["parallelism"], plan.config
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["context_parallel_degree"],
            par["expert_parallel_degree"]) == (cfg.tp, cfg.pp, cfg.cp, cfg.ep)
    # every field 0.3 has holds what the 0.2 TOML holds
    assert {key: par[key] for key in toml["parallelism"] if key in par} == \
        {key: value for key, value in toml["parallelism"].items() if key in par}
    assert set(toml["parallelism"]) - set(par) == {"expert_tensor_parallel_degree"}
    assert job["training"]["global_batch_size"] == cfg.global_batch and job["training"]["seq_len"] == plan.model.seq
    assert job["model"] == ["llama3", "custom"] and job["rest"] == []
    expected_ac = {"selective": "SelectiveAC.Config", "full": "FullAC.Config"}.get(name)
    assert job["activation_checkpoint"] == expected_ac


def test_pipeline_chunks_reach_torchtitan_03(loaded):
    par = loaded["jobs"]["meshplan_job_interleaved"]["parallelism"]
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    parts = par["module_fqns_per_model_part"]  # the plan's chunks of 1, 3, 2 and 2 layers (embed, head included)
    assert parts[0] == ["tok_embeddings"] and parts[-1][-2:] == ["norm", "output"]
    assert [len(part) for part in parts] == [1, 3, 2, 3]
    assert loaded["jobs"]["meshplan_job_zbv"]["parallelism"]["pipeline_parallel_schedule"] == "ZBVZeroBubble"


def test_float8_converter_reaches_torchtitan_03(loaded):
    """0.3 builds the Float8 converter the config names while building the model spec: with torchao
    installed (meshplan's engines extra) it goes as far as its hardware check, which a machine
    without an SM89 GPU fails; without torchao, its import check refuses first."""
    error = loaded["jobs"]["meshplan_job_fp8"]["error"]
    assert error.startswith(("Failed to swap to Float8Linear because float8 is only supported on NVIDIA SM89",
                             "torchao is not installed")), error
