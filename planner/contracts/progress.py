"""Progress of the long stages (the plan search, calibration, training), decided in one place.

Every `progress` argument takes one of:
- False or None: silent;
- True: a tqdm bar on stderr, drawn only when stderr is a terminal (never into a pipe or a file);
- a callable `fn(done, total)`, called with the units done so far (candidates, phases, steps).
"""
from __future__ import annotations

import sys
from typing import Callable, Union

ProgressArg = Union[bool, None, Callable[[int, int], None]]


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class Progress:
    """Counts units of work and tells a bar or a callback; `update(n)` adds, `advance_to(done)` sets."""

    def __init__(self, total: int, callback: Callable[[int, int], None] | None = None, bar=None):
        self.total, self.done = total, 0
        self._callback, self._bar = callback, bar

    def update(self, num: int = 1) -> None:
        self.advance_to(self.done + num)

    def advance_to(self, done: int) -> None:
        done = min(done, self.total)
        if done <= self.done:
            return
        if self._bar is not None:
            self._bar.update(done - self.done)
        self.done = done
        if self._callback is not None:
            self._callback(done, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def progress_reporter(progress: ProgressArg, total: int, desc: str, unit: str) -> Progress | None:
    """A `Progress` for `total` units as `progress` asks (see the module docstring), or None."""
    if callable(progress):
        return Progress(total, callback=progress)
    if not progress or not stderr_is_terminal():
        return None
    from tqdm import tqdm

    return Progress(total, bar=tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False))
