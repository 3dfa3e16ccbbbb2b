"""The search's fork process pool, and Ctrl-C.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group, workers included. The
workers must leave it to the parent, which stops them and prints one line; but a worker that
takes the signal between its fork and its initializer (inside the interpreter's at-fork handlers)
raises KeyboardInterrupt there and prints a traceback. So SIGINT is blocked in the parent while
the workers fork (a signal that arrives meanwhile waits, and is delivered to the parent once the
pool is up); the workers inherit the block, set SIGINT to ignored and only then unblock it.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from functools import partial


def _fork_context():
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else methods[0])


def _start_worker(initializer) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if initializer is not None:
        initializer()


def _quiet_cancelled_future(previous_hook, args) -> None:
    """The pool's manager thread, finding its workers terminated, marks every pending future
    broken, and Python 3.11's raises InvalidStateError on one that the shutdown just cancelled:
    a race of the stop itself, not an error to print."""
    from concurrent.futures import InvalidStateError

    if not isinstance(args.exc_value, InvalidStateError):
        previous_hook(args)


def _stop_workers(pool) -> None:
    """Kill the workers at once and leave the pool's threads nothing to wait for. A worker killed
    while writing a result leaves half a message in the result pipe, which the manager thread
    would read forever (the parent holds the pipe's write end too): closing that end gives it
    the end of the file instead, and it winds the pool down as broken. The call queue's feeder
    may be blocked writing to the dead workers, so nobody waits for it."""
    processes = list(getattr(pool, "_processes", {}).values())
    for process in processes:
        process.kill()
    for process in processes:
        process.join()
    call_queue, result_queue = getattr(pool, "_call_queue", None), getattr(pool, "_result_queue", None)
    if call_queue is not None:
        call_queue.cancel_join_thread()
    writer = getattr(result_queue, "_writer", None)
    if writer is not None:
        writer.close()


@contextlib.contextmanager
def worker_pool(workers: int, initializer=None):
    """A fork pool of `workers` processes, started now (they fork with SIGINT blocked); on Ctrl-C,
    also one that waited while they forked, the workers are terminated at once rather than left
    to finish their tasks."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=_fork_context(),
                                   initializer=partial(_start_worker, initializer))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise
    stopped = False
    try:
        pool.submit(int)  # the fork start method starts every worker on the first submit
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C that waited is raised from here on
        yield pool
    except KeyboardInterrupt:
        previous_hook = threading.excepthook
        threading.excepthook = partial(_quiet_cancelled_future, previous_hook)
        try:
            _stop_workers(pool)
            pool.shutdown(wait=True, cancel_futures=True)  # joins the pool's manager thread
        finally:
            threading.excepthook = previous_hook
        stopped = True
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if not stopped:
            pool.shutdown()
