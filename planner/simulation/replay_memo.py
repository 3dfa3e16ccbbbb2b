"""Results of schedule replays, memoised by their arguments, which start with the schedule's shape
(schedule, p, m, v): a rank's live-activation peaks, reduction windows and freed-before-last-forward
counts, pure functions of the shape that cost a replay of every rank's order.

A solving worker forked before the parent replayed a shape would replay it again: the parent hands
it what it has for the shape of each problem it sends (`entries`, `load`; `search.solving`)."""
from __future__ import annotations

import functools
import inspect

# Per function, per shape (its first four arguments): arguments -> result, so that a shape's
# results are found without scanning the rest. A function's are emptied at MAX_ENTRIES shapes, so a
# long-lived process does not grow without end.
MAX_ENTRIES = 4096
_MEMO: dict[str, dict[tuple, dict[tuple, object]]] = {}


def memoised(fn):
    """`fn` memoised by its arguments, every one positional and defaults filled in (so equal calls
    share a key), the first four the schedule's shape."""
    table = _MEMO.setdefault(f"{fn.__module__}.{fn.__qualname__}", {})
    signature = inspect.signature(fn)
    num_params = len(signature.parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if kwargs or len(args) != num_params:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        of_shape = table.get(args[:4])
        if of_shape is None:
            if len(table) >= MAX_ENTRIES:
                table.clear()
            of_shape = table[args[:4]] = {}
        found = of_shape.get(args)
        if found is None:
            found = of_shape[args] = fn(*args)
        return found

    wrapper.cache_clear = table.clear
    return wrapper


def entries(shape: tuple) -> dict[str, dict[tuple, object]]:
    """Every memoised result for the shape (schedule, p, m, v), by function."""
    return {name: dict(table[shape]) for name, table in _MEMO.items() if table.get(shape)}


def load(found: dict[str, dict[tuple, object]]) -> None:
    """Results another process computed (`entries`), added to this one's memo."""
    for name, items in found.items():
        table = _MEMO.setdefault(name, {})
        for args, value in items.items():
            table.setdefault(args[:4], {})[args] = value


def clear() -> None:
    """Forget every memoised result."""
    for table in _MEMO.values():
        table.clear()
