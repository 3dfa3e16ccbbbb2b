"""Where the report's step timeline comes from: a trace file, or the simulator re-playing the plan.

A trace is what `meshplan simulate --trace` writes. Two shapes are read: the Chrome trace-event
format (`{"traceEvents": [{"ph": "X", "ts": us, "dur": us, "pid": rank, "tid": stream, ...}]}`,
what chrome://tracing and Perfetto open) and meshplan's own interval list
(`{"timeline": [{"rank", "stream", "kind", "start_s", "end_s", ...}]}`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.prediction import INTERVAL_KINDS, Interval

_US = 1e-6
_GIB = 2**30  # the simulator's memory counter is in GiB


def _event_kind(event: dict[str, Any]) -> str | None:
    args = event.get("args") or {}
    for candidate in (args.get("kind"), event.get("cat"), event.get("name")):
        if isinstance(candidate, str) and candidate in INTERVAL_KINDS:
            return candidate
    return None


def _event_rank(event: dict[str, Any]) -> int:
    args = event.get("args") or {}
    for candidate in (args.get("rank"), args.get("pipeline_rank"), event.get("pid")):
        if isinstance(candidate, int) or (isinstance(candidate, str) and candidate.isdigit()):
            return int(candidate)
        if isinstance(candidate, str) and candidate.rsplit(" ", 1)[-1].isdigit():
            return int(candidate.rsplit(" ", 1)[-1])  # "rank 3", "stage 3"
    raise ValueError(f"trace event {event.get('name')!r} does not say which rank it ran on (pid or args.rank)")


def _thread_names(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], str]:
    """(pid, tid) -> stream name, from the `thread_name` metadata events."""
    return {(e.get("pid"), e.get("tid")): str((e.get("args") or {}).get("name"))
            for e in events if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name"}


def _from_chrome_events(events: list[dict[str, Any]]) -> list[Interval]:
    threads = _thread_names(events)
    out = []
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue  # metadata, counters and instant events
        kind = _event_kind(event)
        if kind is None:
            continue
        args = event.get("args") or {}
        tid = event.get("tid")
        stream = args.get("stream") or threads.get((event.get("pid"), tid)) or (
            tid if isinstance(tid, str) else "compute")
        start_s = float(event["ts"]) * _US
        out.append(Interval(rank=_event_rank(event), stream=str(stream), kind=kind, start_s=start_s,
                            end_s=start_s + float(event.get("dur", 0.0)) * _US,
                            microbatch=int(args.get("microbatch", -1)), chunk=int(args.get("chunk", -1))))
    return out


def memory_from_trace(data: Any) -> list[list[tuple[float, float]]]:
    """Per rank [(time_s, live bytes)] from the trace's memory counter events (GiB), if any."""
    events = data.get("traceEvents") if isinstance(data, dict) else None
    curves: dict[int, list[tuple[float, float]]] = {}
    for event in events or ():
        if isinstance(event, dict) and event.get("ph") == "C" and "live" in (event.get("args") or {}):
            curves.setdefault(_event_rank(event), []).append((float(event["ts"]) * _US,
                                                              float(event["args"]["live"]) * _GIB))
    return [sorted(curves.get(rank, [])) for rank in range(max(curves) + 1)] if curves else []


def intervals_from_trace(data: Any) -> list[Interval]:
    """Parse either trace shape into Intervals (raises ValueError on anything else)."""
    if isinstance(data, dict) and "traceEvents" in data:
        return _from_chrome_events(list(data["traceEvents"]))
    if isinstance(data, list) and data and isinstance(data[0], dict) and "ph" in data[0]:
        return _from_chrome_events(data)
    rows = data.get("timeline") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError("a trace must be Chrome trace events ({'traceEvents': [...]}) or {'timeline': [...]}")
    try:
        return [Interval(**row) for row in rows]
    except TypeError as exc:
        raise ValueError(f"malformed timeline entry ({exc})") from None


def load_trace(path: str | Path) -> tuple[list[Interval], list[list[tuple[float, float]]]]:
    """(intervals, per-rank memory curve) from a trace file."""
    from meshplan.planner.contracts.jsonfile import read_json_file

    path = Path(path)
    data = read_json_file(path, "trace", f"write one with `meshplan simulate --plan plan.json --trace {path}`")
    try:
        intervals = intervals_from_trace(data)
    except ValueError as exc:
        raise MeshplanError(f"{path}: {exc}") from None
    if not intervals:
        raise MeshplanError(f"{path} holds no timeline intervals; write it with `meshplan simulate --trace`")
    return intervals, memory_from_trace(data)


def simulate_timeline(plan):
    """Re-play the plan in the simulator; returns its Prediction (with timeline) or None if the
    simulator is not installed in this build."""
    try:
        from meshplan.planner.simulation.simulator import simulate
    except ImportError:
        return None
    return simulate(plan, timeline=True)


def with_idle(intervals: list[Interval], step_time_s: float) -> list[Interval]:
    """Add `idle` intervals for the gaps on each rank's compute stream (unless the source has them).

    The compute stream's gaps between 0 and the step's end are the pipeline bubble plus any wait for
    blocking communication: exactly what the Gantt chart should make visible.
    """
    if any(i.kind == "idle" for i in intervals) or not intervals:
        return list(intervals)
    end_s = max(step_time_s, max(i.end_s for i in intervals))
    out = list(intervals)
    for rank in sorted({i.rank for i in intervals}):
        busy = sorted((i.start_s, i.end_s) for i in intervals if i.rank == rank and i.stream == "compute")
        cursor = 0.0
        for start_s, end_s in busy + [(end_s, end_s)]:
            if start_s > cursor:
                out.append(Interval(rank=rank, stream="compute", kind="idle", start_s=cursor, end_s=start_s))
            cursor = max(cursor, end_s)
    return out


def idle_fraction_per_rank(intervals: list[Interval]) -> dict[int, float]:
    """Share of the step each rank's compute stream is idle (from `idle` intervals)."""
    if not intervals:
        return {}
    end_s = max(i.end_s for i in intervals)
    out = {}
    for rank in sorted({i.rank for i in intervals}):
        idle_s = sum(i.end_s - i.start_s for i in intervals if i.rank == rank and i.kind == "idle")
        out[rank] = idle_s / end_s if end_s > 0 else 0.0
    return out
