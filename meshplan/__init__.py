"""meshplan: plan, predict and run hybrid-parallel training of PyTorch models.

    import meshplan
    graph = meshplan.profile("llama3-8b", seq=4096)
    prediction = meshplan.estimate("llama3-70b", "h100-sxm", gpus=64, global_batch=128, seq=8192, tp=8, pp=4)
    plan = meshplan.plan("llama3-70b", "h100-sxm", gpus=1024, global_batch=1024, seq=8192)
    meshplan.simulate(plan)
    measured = meshplan.train(plan, steps=20, out="measured.json")   # torchrun on this node
    meshplan.write_report(plan, [measured], out="report.html")

Each function imports its stage when called, so `import meshplan` (and `meshplan --help`) does
not pay for torch. The functions print nothing: `plan` and `train` take `progress=` (default
False; True draws a bar on stderr when it is a terminal; a function `fn(done, total)` is called
after each candidate solved or step trained). The stages live in `meshplan.planner`, `meshplan.executor` and
`meshplan.reports`; `docs/architecture.md` maps them.
"""
from __future__ import annotations

__all__ = ["estimate", "load_cluster", "load_plan", "plan", "profile", "simulate", "train", "write_report"]


def profile(spec: str, seq: int, batch: int = 1, dtype: str = "bf16", attention: str = "flash", **kwargs):
    """The `ModelGraph` of a model spec (`meshplan.planner.profiling.profiler.profile`)."""
    from meshplan.planner.profiling.profiler import profile as _profile

    return _profile(spec, seq, batch, dtype, attention, **kwargs)


def estimate(spec: str, cluster, gpus: int, global_batch: int, seq: int | None = None, **kwargs):
    """The `Prediction` of one hand-written configuration (`meshplan.planner.simulation.estimator`)."""
    from meshplan.planner.simulation.estimator import estimate as _estimate

    return _estimate(spec, cluster, gpus, global_batch, seq, **kwargs)


def plan(spec: str, cluster, gpus: int, global_batch: int, seq: int | None = None, *, progress=False, **kwargs):
    """The fastest plan that fits (`meshplan.planner.search.driver.search_plan`); `progress`: False,
    True (a bar when stderr is a terminal) or fn(done, total) per candidate."""
    from meshplan.planner.profiling.profiler import carry_model_graph
    from meshplan.planner.search.driver import search_plan

    # a file or hf: model's plan carries its layer graph: reading the plan never runs its code
    return carry_model_graph(search_plan(spec, cluster, gpus, global_batch, seq, progress=progress, **kwargs))


def simulate(plan, graph=None, timeline: bool = True):
    """Play one training step of a `Plan` (`meshplan.planner.simulation.simulator.simulate`)."""
    from meshplan.planner.simulation.simulator import simulate as _simulate

    return _simulate(plan, graph=graph, timeline=timeline)


def train(plan, *, progress=False, **kwargs):
    """Run a plan with torch.distributed on this node and return its `Measurement`; `progress`:
    False, True (a bar when stderr is a terminal) or fn(done, total) per step."""
    from meshplan.executor import train as _train

    return _train(plan, progress=progress, **kwargs)


def write_report(plan, measurements=(), trace=None, out="report.html", title: str | None = None, **kwargs):
    """Write the HTML strategy report of a plan (and its measurements) to `out`; `others=[...]`
    adds plans shown side by side, `sizing=` a time/cost frontier (read from a plan file's own)."""
    from meshplan.reports import write_report as _write_report

    return _write_report(plan, measurements, trace, out, title, **kwargs)


def load_cluster(name_or_path):
    """A built-in cluster profile by name (`h100-sxm`) or a TOML file by path."""
    from meshplan.planner.costing.hardware import load_cluster as _load_cluster

    return _load_cluster(name_or_path)


def load_plan(path):
    """A `Plan` from a plan JSON file."""
    from meshplan.planner.contracts.plan import load_plan as _load_plan

    return _load_plan(path)
