"""Read a user-supplied JSON file with one-line errors (missing file, invalid JSON) and a fix."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshplan.planner.contracts.errors import MeshplanError


def read_json_file(path: str | Path, what: str, fix: str) -> Any:
    """Parsed JSON of `path`; `what` names the file kind ("plan"), `fix` says how to make one."""
    path = Path(path)
    if not path.exists():
        raise MeshplanError(f"{what} file not found: {path}; {fix}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MeshplanError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); {fix}") from None
