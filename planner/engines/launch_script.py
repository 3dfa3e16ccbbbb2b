"""Flags and their values from a command-line argument list or a shell launch script (the form
Megatron-LM jobs are published in): `parse_arguments`."""
from __future__ import annotations

import itertools
import re
import shlex

# Megatron-LM's flags that take several values (nargs="*"), read whole
_LIST_FLAGS = ("--recompute-modules",)


def parse_arguments(text: str) -> dict[str, str | None]:
    """Megatron flags and their values from an argument list or a launch script.

    Scripts: `NAME=value` assignments are substituted for `$NAME`, `${NAME}` and `${NAME:-default}`;
    every `--flag [value]` token in the file counts (array bodies included); the last one wins.
    """
    variables = _assignments(text)
    tokens: list[str] = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        try:
            parts = shlex.split(_substitute(line, variables), comments=True)
        except ValueError:
            parts = _substitute(line, variables).split()
        for part in parts:
            tokens.extend(part.split() if part.startswith("--") else [part])
    flags: dict[str, str | None] = {}
    for index, token in enumerate(tokens):
        if not token.startswith("--") or token == "--":
            continue
        name, eq, value = token.partition("=")
        if eq:
            flags[name] = value
            continue
        if name in _LIST_FLAGS:  # every value up to the next flag, space-separated
            values = itertools.takewhile(lambda t: not t.startswith("--") and t not in ("(", ")"), tokens[index + 1:])
            flags[name] = " ".join(values) or None
            continue
        following = tokens[index + 1] if index + 1 < len(tokens) else None
        flags[name] = None if following is None or following.startswith("--") or following in ("(", ")") \
            else following
    return flags


_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(\S*)\s*(?:#.*)?$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def _assignments(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        match = _ASSIGN.match(line)
        if match and not match.group(2).startswith("("):
            out[match.group(1)] = _substitute(match.group(2).strip("\"'"), out)
    return out


def _substitute(text: str, variables: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        default = match.group(2)
        return variables.get(name, default if default is not None else match.group(0))
    return _VAR.sub(value, text)
