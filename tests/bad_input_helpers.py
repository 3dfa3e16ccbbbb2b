"""Shared pieces of the bad-input tests: small inputs, hypothesis settings, the clean-exit check."""
from __future__ import annotations

import json
import math
import os
import tomllib

import pytest
from hypothesis import HealthCheck, settings

from meshplan.planner.costing.hardware import PROFILES_DIR

SMALL = "gpt:layers=2,hidden=64,heads=4,vocab=128"
SEQ = 32


def fast(num_examples: int) -> settings:
    """Few examples, no per-example deadline (the first one profiles the model); function-scoped
    fixtures (run_cli, tmp_path) are shared across examples on purpose: each example overwrites
    the files it uses. MESHPLAN_FUZZ=N runs N times as many (a longer hunt than `make test`'s)."""
    return settings(max_examples=num_examples * int(os.environ.get("MESHPLAN_FUZZ", "1")), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True, scope="module")
def private_cache(tmp_path_factory):
    """A profile cache of this module's own, so no other test's cache entries are read."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def assert_clean(command: str, code: int, err: str) -> None:
    """Exit 0, or exit 2 with exactly one `meshplan CMD: error: ...` line; never exit 1."""
    assert "Traceback" not in err, err
    assert code in (0, 2), f"exit {code}: {err}"
    if code == 2:  # a file model's notice before its code runs is not part of the error
        lines = [line for line in err.splitlines() if line.strip() and "running model code from" not in line]
        assert len(lines) == 1, f"expected one line on stderr, got {lines}"
        assert lines[0].startswith(f"meshplan {command}: error: "), lines[0]



# Cluster profiles as TOML text

def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # JSON escapes control characters as TOML does, except DEL; astral characters stay raw
        # (JSON's surrogate pairs are not valid TOML escapes).
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"


def toml_text(data: dict, prefix: tuple[str, ...] = ()) -> str:
    """TOML for a profile-shaped dict: scalars first, then sub-tables; peak FLOP/s inline."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict) or k == "peak_flops_per_s"]
    for key, value in data.items():
        if isinstance(value, dict) and key != "peak_flops_per_s":
            lines += ["", f"[{'.'.join(prefix + (key,))}]", toml_text(value, prefix + (key,))]
    return "\n".join(lines)


def base_cluster() -> dict:
    return tomllib.loads((PROFILES_DIR / "cpu.toml").read_text())
