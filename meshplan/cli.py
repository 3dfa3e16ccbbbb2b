"""The `meshplan` command line: argparse front end over the public functions.

Each subcommand lives in `planner/commands/<name>.py` and exposes `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only for the command that runs, so `--help` stays fast.
User errors (`MeshplanError`, `ValueError`, missing files) exit with code 2 and one line on stderr;
anything else is an internal error (exit 1). `--debug` shows the traceback. Ctrl-C prints one
line and exits 130 (worker processes are stopped by the stage that started them); a closed output
pipe (`meshplan simulate ... | head -1`) ends quietly with exit 0.
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module

COMMANDS = {
    "profile": "a model's per-layer graph of FLOPs and bytes (closed form for built-in transformers, else traced)",
    "estimate": "predict step time and memory of one hand-written parallel configuration",
    "plan": "search the fastest plan that fits (ILP over layers, simulator re-ranks)",
    "memory": "a model's memory across precisions, ZeRO stages and GPU counts (no cluster or batch needed)",
    "simulate": "play one training step of a plan event by event",
    "calibrate": "measure this machine (matmul, memory, collectives) into a cluster profile",
    "train": "run a plan for real with torch.distributed and measure it",
    "report": "write a self-contained HTML strategy report",
    "export": "write a plan as a torchtitan TOML, Megatron-LM arguments or a DeepSpeed JSON",
    "measured": "read a Megatron-LM, NeMo, torchtitan or DeepSpeed training log into a measured.json",
    "compare": "side-by-side table of two or more plans (differences marked)",
    "demo": "the whole loop on this machine: calibrate, profile, plan, train, report",
}
# Commands that hold no processes, sockets or temporary files once they return: they leave
# without the interpreter's teardown of torch's modules, which costs 0.6-0.9 s per command.
FAST_EXIT_COMMANDS = frozenset({"profile", "estimate", "memory", "simulate", "plan", "export", "compare"})


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors in one line and where to read more, not the whole usage text."""

    def error(self, message: str):
        print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="meshplan",
        description="meshplan: how to parallelize a PyTorch model on a cluster, how fast it goes, "
        "how much memory each GPU needs, and then run it.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"meshplan {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.command_parsers = {}
    for name, help_text in COMMANDS.items():
        cmd_parser = parser.command_parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        cmd_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                help="show tracebacks for errors")
        _command_module(name).add_arguments(cmd_parser)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshplan")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def _command_module(name: str):
    return import_module(f"meshplan.commands.{name}")


# Ctrl-C and third-party imports: some libraries import optional pieces under bare `except:`
# clauses, which swallow a KeyboardInterrupt raised inside them and let the command run on (or
# fail later on a half-imported module). The SIGINT handler `main` installs therefore does not
# raise inside an import: it delivers the interrupt again 20 ms later, until the imports are done.
_INTERRUPTED = {"seen": False}
_REDELIVER_S = 0.02


def _inside_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum, frame):
    _INTERRUPTED["seen"] = True
    if _inside_import(frame):
        import _thread
        import threading

        threading.Timer(_REDELIVER_S, _thread.interrupt_main).start()
        return
    raise KeyboardInterrupt


def _install_sigint_handler() -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (also used in-process by tests)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _INTERRUPTED["seen"] = False
    _install_sigint_handler()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # also while parsing or importing, before a command runs
        return _interrupted(next((arg for arg in argv if not arg.startswith("-")), None))
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say, and nobody to say it to
        _silence_stdout()
        return 0


def _interrupted(command: str | None) -> int:
    print(f"meshplan{f' {command}' if command in COMMANDS else ''}: interrupted", file=sys.stderr)
    return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (captured by tests)
        pass


def _main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:  # named by the command's own parser, so the hint is that command's --help
            from meshplan.flag_hints import hint

            command_parser = parser.command_parsers.get(args.command, parser)
            command_parser.error(f"unrecognized arguments: {' '.join(extras)}"
                                 f"{hint(extras, command_parser._option_string_actions)}")
    except SystemExit as exc:  # argparse: usage errors exit 2 with their one line already printed
        return int(exc.code or 0)
    if not args.command:
        parser.print_help()
        return 2
    debug = getattr(args, "debug", False)
    from meshplan.planner.contracts.errors import MeshplanError

    try:
        return int(_command_module(args.command).run(args) or 0)
    except (MeshplanError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError,
            PermissionError) as exc:
        if debug:
            raise
        if _INTERRUPTED["seen"]:
            return _interrupted(args.command)
        print(f"meshplan {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        return _interrupted(args.command)
    except BrokenPipeError:
        raise  # handled in main: quiet
    except Exception as exc:  # an internal error: say so, and how to see more
        if debug:
            raise
        if _INTERRUPTED["seen"]:  # the Ctrl-C a library swallowed surfaced as this error
            return _interrupted(args.command)
        print(f"meshplan {args.command}: internal error ({type(exc).__name__}): {_one_line(exc)}; "
              "rerun with --debug for the traceback", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    text = str(exc) if str(exc) else type(exc).__name__
    if isinstance(exc, OSError) and exc.filename:
        text = f"{exc.strerror}: {exc.filename}"
    return " ".join(text.split())


def console_main() -> None:
    """The `meshplan` executable: `main`, then a fast exit for the analysis commands."""
    argv = sys.argv[1:]
    code = main(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    except KeyboardInterrupt:
        code = _interrupted(command)
    if command in FAST_EXIT_COMMANDS:
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
