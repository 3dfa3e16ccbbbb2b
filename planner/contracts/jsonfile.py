"""Read a user-supplied input file with one-line errors (missing file, not a regular file, too large,
invalid or too deeply nested JSON) and a fix.

Every JSON or TOML input meshplan reads (plans, measurements, traces, cluster profiles, engine
configs) goes through `read_input_text`: a device, FIFO or directory is refused before it is read
(`--cluster /dev/zero` would never end), and so is a file above `MAX_INPUT_BYTES`.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from meshplan.planner.contracts.errors import MeshplanError

# Far above any real input (a plan carrying a 1,000-layer graph is a few MB); reading stops there.
MAX_INPUT_BYTES = 64 * 2**20


def read_input_text(path: str | Path, what: str, fix: str, limit_bytes: int | None = None) -> str:
    """The UTF-8 text of a regular file of at most `limit_bytes` (default MAX_INPUT_BYTES); `what` names
    the file kind ("plan")."""
    limit_bytes = MAX_INPUT_BYTES if limit_bytes is None else limit_bytes
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise MeshplanError(f"{what} file not found: {path}; {fix}") from None
    except OSError as exc:
        raise MeshplanError(f"cannot read {what} file {path}: {exc.strerror or exc}; {fix}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise MeshplanError(f"{what} file {path} is {kind}; give the path of a {what} file")
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit_bytes + 1)  # bounded even if the file grows while it is read
    except OSError as exc:
        raise MeshplanError(f"cannot read {what} file {path}: {exc.strerror or exc}; {fix}") from None
    if len(data) > limit_bytes:
        raise MeshplanError(f"{what} file {path} is larger than meshplan's limit of {limit_bytes / 2**20:g} MiB "
                            f"for input files; {fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MeshplanError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start}); {fix}") from None


def parse_json_text(text: str, source: str | Path, fix: str) -> Any:
    """Parsed JSON; invalid or too deeply nested JSON (Python's recursion limit) is one line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MeshplanError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno}); {fix}") from None
    except RecursionError:
        raise MeshplanError(f"{source} is nested too deeply to be a meshplan input (arrays or objects "
                            f"nested hundreds of levels); {fix}") from None


def read_json_file(path: str | Path, what: str, fix: str) -> Any:
    """Parsed JSON of `path`; `what` names the file kind ("plan"), `fix` says how to make one."""
    return parse_json_text(read_input_text(path, what, fix), path, fix)
