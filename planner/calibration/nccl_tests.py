"""Read the output of NVIDIA's nccl-tests (`all_reduce_perf`, `all_gather_perf`,
`reduce_scatter_perf`): the table it prints on stdout, one row per message size.

The shape read (nccl-tests 2.x; older versions have no `root` column and say `error` for
`#wrong`, which the header names, so columns are found by name):

    # Collective test starting: all_reduce_perf
    # nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor) ...
    # Using devices
    #  Rank  0 Group  0 Pid  1234 on     node01 device  0 [0x18] NVIDIA H100 80GB HBM3
    ...
    #                                                   out-of-place                       in-place
    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
      1073741824     268435456     float     sum      -1   5412.3  198.39  347.18      0   5408.1  198.54  347.45      0

Each row keeps the faster of its out-of-place and in-place times (the least disturbed run, as
`meshplan calibrate` keeps the fastest repetition). The `Rank ... on HOST` lines give the number
of ranks and of nodes (distinct hosts) the test ran on.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
_RANK_LINE = re.compile(r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device")
_STARTING = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
# File names people give these outputs: all_reduce_perf.txt, allreduce-16n.log, ...
_NAME_KINDS = {"all_reduce": "all_reduce", "allreduce": "all_reduce", "all_gather": "all_gather",
               "allgather": "all_gather", "reduce_scatter": "reduce_scatter", "reducescatter": "reduce_scatter"}


@dataclass(frozen=True)
class NcclTestsRun:
    """One nccl-tests output: which collective, on how many ranks and nodes, and its timings."""

    path: str
    kind: str  # one of KINDS
    num_ranks: int | None  # None when the file lists no `Rank` lines
    num_nodes: int | None
    samples: tuple[tuple[float, float], ...]  # (size bytes, seconds), ascending size


def read_nccl_tests(path: str | Path) -> NcclTestsRun:
    """Parse one nccl-tests output file; anything else is a MeshplanError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise MeshplanError(f"nccl-tests file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise MeshplanError(f"{path}: not a text file; pass the stdout of all_reduce_perf or all_gather_perf") from None
    return parse_nccl_tests(text, str(path))


def parse_nccl_tests(text: str, where: str) -> NcclTestsRun:
    lines = text.splitlines()
    header_index, columns = _find_header(lines, where)
    samples, ratios = _read_rows(lines, header_index, columns, where)
    hosts = {match.group(2) for match in map(_RANK_LINE.match, lines) if match}
    ranks = sum(1 for line in lines if _RANK_LINE.match(line))
    num_ranks, num_nodes = (ranks, len(hosts)) if ranks else (None, None)
    kind = _kind(lines, where, num_ranks, ratios)
    return NcclTestsRun(where, kind, num_ranks, num_nodes, tuple(sorted(samples)))


def _find_header(lines: list[str], where: str) -> tuple[int, list[str]]:
    for index, line in enumerate(lines):
        tokens = line.lstrip("#").split()
        if line.startswith("#") and "size" in tokens and "time" in tokens and "busbw" in tokens:
            return index, tokens
    raise MeshplanError(f"{where}: no nccl-tests table found (a '#  size  count  type ...  time  algbw  busbw' "
                        "header); pass the stdout of all_reduce_perf, all_gather_perf or reduce_scatter_perf")


def _read_rows(lines: list[str], header_index: int, columns: list[str],
               where: str) -> tuple[list[tuple[float, float]], list[float]]:
    """(size, fastest seconds) per data row, and each row's busbw / algbw ratio."""
    size_at = columns.index("size")
    times_at = [i for i, name in enumerate(columns) if name == "time"]
    algbw_at = [i for i, name in enumerate(columns) if name == "algbw"]
    busbw_at = [i for i, name in enumerate(columns) if name == "busbw"]
    wrong_at = [i for i, name in enumerate(columns) if name == "#wrong"]
    samples, ratios = [], []
    for number, line in enumerate(lines[header_index + 1:], start=header_index + 2):
        tokens = line.split()
        if not tokens or line.lstrip().startswith("#") or not tokens[0].isdigit():
            continue  # units line, summary lines, NCCL's own messages
        if len(tokens) != len(columns):
            raise MeshplanError(f"{where} line {number}: {len(tokens)} columns where the header names "
                                f"{len(columns)}; is the table cut or mixed with other output?")
        wrong = sum(_number(tokens[i]) or 0 for i in wrong_at)
        if wrong:
            raise MeshplanError(f"{where} line {number}: nccl-tests counted {wrong:g} wrong results; a run that "
                                "fails validation does not measure the fabric")
        times_us = [_number(tokens[i]) for i in times_at]
        times_us = [t for t in times_us if t is not None and t > 0]
        if not times_us:
            raise MeshplanError(f"{where} line {number}: no positive time in the time columns ({line.strip()!r})")
        samples.append((float(tokens[size_at]), min(times_us) * 1e-6))
        algbw, busbw = _number(tokens[algbw_at[0]]), _number(tokens[busbw_at[0]])
        if algbw and busbw:
            ratios.append(busbw / algbw)
    if len({size for size, _ in samples}) < 2:
        raise MeshplanError(f"{where}: {len(samples)} row(s) in the nccl-tests table; the fit needs at least two "
                            "message sizes (run with e.g. -b 1M -e 8G -f 2)")
    return samples, ratios


def _number(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None  # nccl-tests prints N/A where a variant was not run


def _kind(lines: list[str], where: str, num_ranks: int | None, ratios: list[float]) -> str:
    """The collective: nccl-tests' own 'Collective test starting' line, else the file name, else
    the bus bandwidth factor (2 (n-1)/n for all-reduce, (n-1)/n for all-gather)."""
    for line in lines:
        match = _STARTING.match(line)
        if match:
            name = match.group(1).removesuffix("_mpi").removesuffix("_perf")
            if name not in KINDS:
                raise MeshplanError(f"{where}: {match.group(1)} output; meshplan fits the fabric to all_reduce_perf, "
                                    "all_gather_perf or reduce_scatter_perf")
            return name
    stem = Path(where).name.lower().replace("-", "_")
    for key, kind in _NAME_KINDS.items():
        if key in stem:
            return kind
    if num_ranks and ratios:
        ratio = sum(ratios) / len(ratios)
        for kind, factor in (("all_reduce", 2 * (num_ranks - 1) / num_ranks), ("all_gather", (num_ranks - 1) / num_ranks)):
            if abs(ratio - factor) <= 0.02 * factor:
                return kind
    raise MeshplanError(f"{where}: cannot tell which collective this measured; keep nccl-tests' '# Collective test "
                        "starting' line or name the file after it (all_reduce..., all_gather...)")
