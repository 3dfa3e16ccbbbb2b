"""meshplan planner: profile a model, cost it on a cluster, solve for a plan, simulate it.

The public functions are imported lazily so that `meshplan --help` and small commands do not pay
for importing torch.
"""
from importlib import import_module

_API = {
    "profile": ("planner.profile", "profile"),
    "load_cluster": ("planner.hardware", "load_cluster"),
    "estimate": ("planner.estimate", "estimate"),
    "simulate": ("planner.simulate", "simulate"),
    "plan": ("planner.solve", "plan"),
    "load_plan": ("planner.plan", "load_plan"),
}

__all__ = sorted(_API)


def __getattr__(name):
    if name not in _API:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    module_name, attr = _API[name]
    return getattr(import_module(module_name), attr)
