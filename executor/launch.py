"""Launch the workers with torchrun (`torch.distributed.run`) in a subprocess, one per rank.

The agent runs in its own process group (session), killed as a whole before returning whatever
happened (a worker crash, a timeout, Ctrl-C, SIGTERM: `Terminated`, exit 143); the agent gets
SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG, even on SIGKILL); torchrun
puts each worker in a session of its own,
so the launcher also kills any worker still alive from the heartbeats they write at start-up,
and workers exit by themselves when their agent dies. No worker outlives the run. Restarts use a fresh rendezvous store per attempt
(`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`): with the shared store, restarted gloo workers find
stale addresses and fail to connect (pytorch#135712). When ranks time out waiting in a
collective, the failure names the rank(s) they waited for (`describe_hang`). Both rendezvous
stores listen on 127.0.0.1 only (`executor.loopback`).
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.calibration.host import threads_per_process

TAIL_LINES = 400
LOOPBACK_INTERFACE = "lo"
KILL_GRACE_S = 5.0


class TrainingFailed(MeshplanError):
    """A worker failed; the message names the rank and what it reported."""


class Terminated(SystemExit):
    """SIGTERM reached the launcher: the workers were stopped; exit status 128 + SIGTERM, as the
    signal's default action would give, but after the cleanup."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


@dataclass(frozen=True)
class LaunchResult:
    exit_code: int
    output_tail: str


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(nproc: int, max_restarts: int, worker_args: list[str], port: int) -> list[str]:
    """torchrun on this node only: its rendezvous and rank 0's store on loopback (`executor.loopback`)."""
    return [sys.executable, "-m", "meshplan.executor.loopback", f"--nproc-per-node={nproc}", "--nnodes=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--local-addr=127.0.0.1",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", "-m", "meshplan.executor.worker", *worker_args]


def launch_jobs(jobs: list[dict], nproc: int, run_dir: str | Path, max_restarts: int = 0,
                timeout_s: float | None = None, echo: bool = False, progress=False) -> LaunchResult:
    """Run `jobs` (Job fields as dicts) one after another in one torchrun launch of `nproc` workers.

    Raises TrainingFailed naming the failed rank when the launch does not succeed. `progress`
    (`planner.contracts.progress`) follows rank 0's completed steps of the jobs.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for directory in {Path(job.get("run_dir") or run_dir) for job in jobs}:  # a fresh launch: no stale failures
        for stale in (*directory.glob("error_rank*.txt"), directory / "fatal.txt"):
            stale.unlink(missing_ok=True)
    jobs_path = run_dir / "jobs.json"
    jobs_path.write_text(json.dumps([{**job, "run_dir": job.get("run_dir") or str(run_dir)} for job in jobs]))
    command = torchrun_command(nproc, max_restarts, ["--jobs", str(jobs_path)], free_port())
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if LOOPBACK_INTERFACE in {name for _, name in socket.if_nameindex()}:
        # the collectives' own sockets (gloo pairs, NCCL's bootstrap) on loopback too: one node
        env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
        env.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    env["OMP_NUM_THREADS"] = str(threads_per_process(nproc, env))  # as calibrate measured (calibration.host)
    handles_sigterm = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if handles_sigterm else None
    try:
        result = _run_in_own_group(command, env, timeout_s, echo, _step_watcher(jobs, run_dir, progress))
    finally:  # also on Ctrl-C and SIGTERM: no worker outlives the launch
        for directory in {Path(job.get("run_dir") or run_dir) for job in jobs}:
            _kill_leftover_workers(directory)
        if handles_sigterm:
            signal.signal(signal.SIGTERM, previous)
    if result.exit_code != 0:
        raise TrainingFailed(describe_failure(result, run_dir, timeout_s))
    return result


def _step_watcher(jobs: list[dict], run_dir: Path, progress):
    """A function reporting rank 0's completed steps (its heartbeat file) to `progress`, or None."""
    from meshplan.planner.contracts.progress import progress_reporter

    reporter = progress_reporter(progress, sum(int(job.get("steps") or 0) for job in jobs), "meshplan train", "step")
    if reporter is None:
        return None
    beats = [Path(job.get("run_dir") or run_dir) / "rank0.json" for job in jobs]

    def watch(finished: bool = False) -> None:
        done = 0
        for beat in beats:
            try:
                done += int(json.loads(beat.read_text())["step"])
            except (OSError, ValueError, KeyError):
                pass
        reporter.advance_to(done)
        if finished:
            reporter.close()

    return watch


def _die_with_parent() -> None:
    """In the agent before exec: SIGTERM it when the launcher dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own cleanup still runs on SIGTERM and Ctrl-C


PR_SET_PDEATHSIG = 1


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise Terminated()


def _run_in_own_group(command: list[str], env: dict, timeout_s: float | None, echo: bool,
                      watch=None) -> LaunchResult:
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, preexec_fn=_die_with_parent)
    # Set when the launcher itself is interrupted (Ctrl-C, SIGTERM): what torchrun prints while it
    # is stopped (its SignalException traceback) is kept in the tail but not echoed; the command
    # says "interrupted" in one line.
    stopping = threading.Event()

    def pump():
        for line in process.stdout:
            tail.append(line)
            if echo and not stopping.is_set():
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        exit_code = _wait(process, timeout_s, watch)
    except subprocess.TimeoutExpired:
        exit_code = -int(signal.SIGKILL)
        tail.append(f"meshplan: the run exceeded its {timeout_s:.0f} s limit and was stopped\n")
    except BaseException:
        stopping.set()
        raise
    finally:  # whatever happened (a Ctrl-C too), nothing of this launch survives it
        _kill_group(process)
        if watch is not None:
            watch(finished=True)
    reader.join(timeout=KILL_GRACE_S)
    return LaunchResult(exit_code=exit_code, output_tail="".join(tail))


def _wait(process: subprocess.Popen, timeout_s: float | None, watch) -> int:
    """`process.wait(timeout_s)`, calling `watch()` every half second meanwhile."""
    if watch is None:
        return process.wait(timeout=timeout_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise subprocess.TimeoutExpired(process.args, timeout_s)
        try:
            return process.wait(timeout=0.5 if left is None else min(0.5, left))
        except subprocess.TimeoutExpired:
            watch()


def _kill_group(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            try:  # the agent is gone; make sure its workers are too
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def _kill_leftover_workers(run_dir: Path) -> None:
    """torchrun starts each worker in its own session, out of reach of the launcher's process
    group kill: SIGKILL any worker whose heartbeat (written at start-up) names a live process.
    The workers also exit by themselves once their agent is gone (see executor.worker)."""
    for beat in run_dir.glob("rank*.json"):
        try:
            pid = int(json.loads(beat.read_text())["pid"])
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                is_worker = b"meshplan.executor.worker" in cmdline.read()
        except (OSError, ValueError, KeyError):
            continue  # no such process (or no /proc): nothing left to stop
        if is_worker:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


TIMED_OUT = re.compile(r"timed?[ _-]?out|timeout", re.IGNORECASE)
PEER_GONE = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)


def describe_hang(run_dir: Path) -> str | None:
    """When ranks timed out in a collective (and any other recorded error is a peer that went away),
    the ranks that recorded nothing are the ones they waited for: name them (with the step they
    were in), or None.

    Exact when every waiting rank times out, or sees a timed-out peer go, before the launcher
    stops it; otherwise the stopped bystanders are named as well."""
    errors = {}
    for path in run_dir.glob("error_rank*.txt"):
        suffix = path.stem[len("error_rank"):]
        if suffix.isdigit():
            errors[int(suffix)] = path.read_text().strip()
    timed_out = [rank for rank, text in errors.items() if TIMED_OUT.search(text)]
    # Once a waiting rank gives up and exits, its peers may see it go rather than time out.
    if not timed_out or not all(rank in timed_out or PEER_GONE.search(text) for rank, text in errors.items()):
        return None
    steps = {}
    for path in run_dir.glob("rank*.json"):
        suffix = path.stem[len("rank"):]
        try:
            steps[int(suffix)] = int(json.loads(path.read_text())["step"])
        except (ValueError, KeyError, OSError):
            continue
    silent = sorted(set(steps) - set(errors))
    if not silent:
        return None
    names = ", ".join(f"{rank} (in step {steps[rank] + 1})" for rank in silent)
    waiting = ", ".join(str(rank) for rank in sorted(timed_out))
    first = errors[min(timed_out)]
    return (f"{_ranks(silent)} {names} stopped responding: {_ranks(timed_out)} {waiting} timed out waiting in a "
            f"collective (--timeout-s) and the launcher stopped the rest; rank {min(timed_out)} reported: "
            f"{first[:300]}")


def _ranks(ranks) -> str:
    return "rank" if len(ranks) == 1 else "ranks"


# What a rank records when another rank died under it (gloo's and NCCL's words): a consequence, not a cause.
PEER_LOSS = ("connection reset by peer", "connection closed by peer", "broken pipe", "remote process exited")
_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def _blamed_failure(text: str, run_dir: Path) -> tuple[int, int | None] | None:
    """(rank, exit code) of the failure to name: torchrun's root cause (its first observed failure),
    unless that rank recorded only the loss of a peer (`PEER_LOSS`) and another failed rank did not:
    torchrun observes the ranks' deaths in one poll, so a rank killed outright and the rank whose
    collective it broke can come out in either order."""
    before, marker, after = text.partition("Root Cause")
    root = after if marker else text
    match = _FAILURE.search(root)
    if match is None:
        rank = re.search(r"rank\s*:\s*(\d+)", root)
        return (int(rank.group(1)), None) if rank else None
    first = (int(match.group(1)), int(match.group(2)))

    def peer_loss(rank: int) -> bool:
        path = run_dir / f"error_rank{rank}.txt"
        return path.is_file() and any(words in path.read_text().lower() for words in PEER_LOSS)
    if not marker or not peer_loss(first[0]):
        return first
    others = ((int(rank), int(code)) for rank, code in _FAILURE.findall(before))
    return next((entry for entry in others if not peer_loss(entry[0])), first)


def describe_failure(result: LaunchResult, run_dir: Path, timeout_s: float | None) -> str:
    """One line: which rank failed first, how, and the error it recorded."""
    hang = describe_hang(run_dir)
    if hang:
        return hang
    text = result.output_tail
    blamed = _blamed_failure(text, run_dir)
    rank = blamed[0] if blamed else None
    parts = []
    if blamed:
        how = ""
        if blamed[1] is not None:
            value = blamed[1]
            how = f" (killed by {signal.Signals(-value).name})" if value < 0 and -value in signal.valid_signals() \
                else f" with exit code {value}"
        parts.append(f"rank {rank} failed{how}")
    elif result.exit_code < 0 and -result.exit_code in signal.valid_signals() and "exceeded its" not in text:
        parts.append(f"the torchrun agent was killed by {signal.Signals(-result.exit_code).name}")
    errors = sorted(run_dir.glob("error_rank*.txt"))
    own = [p for p in errors if rank is not None and p.name == f"error_rank{rank}.txt"]
    aborted = re.findall(r"what\(\):\s*(.+)", text)  # a C++ exception that killed a worker (SIGABRT)
    if own:
        parts.append(own[0].read_text().strip())
    elif aborted:
        parts.append(aborted[0].strip())
    elif errors:
        parts.append(f"{errors[0].stem.replace('error_', '')} reported: {errors[0].read_text().strip()}")
    elif "exceeded its" in text:
        parts.append(text.strip().splitlines()[-1])
    if not parts:
        last = [line for line in text.strip().splitlines() if line.strip()][-3:]
        parts.append("training failed: " + " | ".join(last) if last else "training failed with no output")
    return "; ".join(parts)
