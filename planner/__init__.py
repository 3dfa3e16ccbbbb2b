"""meshplan planner: profile a model, cost it on a cluster, solve for a plan, simulate it.

Public API: `planner.profile(spec, seq)`, `planner.estimate(...)`, `planner.plan(...)`,
`planner.simulate(plan)`, `planner.load_cluster(name)`, `planner.load_plan(path)`.

Functions are imported lazily so that `meshplan --help` and small commands do not pay for
importing torch. Four of them share their name with a submodule (`planner/profile.py` holds
`profile`, ...). Python binds `planner.<name>` to the submodule once it is imported, so those
submodules are made callable: `planner.simulate(plan)` works whether or not
`planner.simulate` was imported before, and `planner.simulate.simulate_config` stays reachable.
"""
import sys
import types
from importlib import import_module

_API = {
    "profile": ("planner.profile", "profile"),
    "load_cluster": ("planner.hardware", "load_cluster"),
    "estimate": ("planner.estimate", "estimate"),
    "simulate": ("planner.simulate", "simulate"),
    "plan": ("planner.solve", "plan"),
    "load_plan": ("planner.plan", "load_plan"),
}
# Submodules whose name is also a public function.
_CALLABLE_MODULES = ("profile", "estimate", "simulate", "plan")

__all__ = sorted(_API)


class _CallableModule(types.ModuleType):
    """A submodule that, called, runs the public function of the same name."""

    def __call__(self, *args, **kwargs):
        module_name, attr = _API[self.__name__.rpartition(".")[2]]
        return getattr(import_module(module_name), attr)(*args, **kwargs)


def make_callable_module(module_name: str) -> None:
    """Called at the end of each of `_CALLABLE_MODULES` with its own `__name__`."""
    sys.modules[module_name].__class__ = _CallableModule


def __getattr__(name):
    if name not in _API:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    if name in _CALLABLE_MODULES:
        return import_module(f"planner.{name}")
    module_name, attr = _API[name]
    return getattr(import_module(module_name), attr)
