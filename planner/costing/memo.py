"""The one memo rule of the cost model's search-time caches: `layer_cost`'s `memo`, a dict the
search's cost tables keep for one graph on one cluster (`tables.build_cost_table`), under keys
that name everything a result reads (tests hold memoised costs equal to fresh ones)."""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def through(memo: dict | None, key: tuple, compute: Callable[..., T], *args) -> T:
    """`compute(*args)`, looked up in `memo` under `key` and kept there; computed afresh without a memo."""
    if memo is None:
        return compute(*args)
    found = memo.get(key)
    if found is None:
        found = memo[key] = compute(*args)
    return found
