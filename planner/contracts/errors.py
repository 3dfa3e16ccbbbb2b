"""The one error type users see: bad input or an impossible request (exit code 2), and the
"did you mean" every unknown name is answered with."""
from __future__ import annotations

import difflib
import re


class MeshplanError(ValueError):
    """A problem the user can fix. The message names the problem and the fix, on one line."""


class PlanNeedsModelCode(MeshplanError):
    """Reading a plan would need its model's code run (an older plan of a file or hf: model that
    carries no layer graph): refused, since commands that read plans never run model code."""


def did_you_mean(text: str, names: list[str]) -> str:
    """" (did you mean ...?)" naming the `names` a mistyped `text` most likely means: those it spells
    with other case or separators (`Llama3_8B` -> llama3-8b), else those it begins (`h100` -> every
    H100 part), else the closest spellings; "" when `text` is one of them or none is close."""
    def plain(value: str) -> str:
        return re.sub(r"[^a-z0-9]", "", value.lower())
    key = text.lower()
    if text in names or not plain(text):
        return ""
    near = ([name for name in names if plain(name) == plain(text)]
            or [name for name in names if name.startswith(key) or plain(name).startswith(plain(text))]
            or difflib.get_close_matches(key, names, n=3, cutoff=0.6))
    if not near:
        return ""
    listed = near[0] if len(near) == 1 else f"{', '.join(near[:-1])} or {near[-1]}"
    return f" (did you mean {listed}?)"
