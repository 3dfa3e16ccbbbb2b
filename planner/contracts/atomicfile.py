"""Write an output file so a reader sees the old content or the new, never a torn one.

`write_text_atomic` writes a temporary file in the target's directory, fsyncs it and renames it
over the target (a rename within one file system is atomic). A full disk, a read-only directory or
any other OS error leaves the old file as it was, removes the temporary file, and is reported as
one `MeshplanError` line with the OS's reason ("No space left on device"). A target that exists
and is not a regular file (a device such as /dev/null or /dev/full, a FIFO) is written in place:
there is no old content to keep, and renaming over a device node would replace it.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError


def write_text_atomic(path: str | Path, text: str, what: str = "output") -> Path:
    """Write `text` (UTF-8) to `path` atomically; `what` names the file in errors ("--out")."""
    return write_bytes_atomic(path, text.encode("utf-8"), what)


def write_bytes_atomic(path: str | Path, data: bytes, what: str = "output") -> Path:
    path = Path(path)
    target = Path(os.path.realpath(path))  # through a symlink: replace the file it names, keep the link
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise _error(what, path, exc) from None
    if mode is not None and stat.S_ISDIR(mode):
        raise MeshplanError(f"cannot write {what} {path}: it is a directory; give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        _write_in_place(target, data, what, path)
        return path
    _replace(target, data, what, path, None if mode is None else stat.S_IMODE(mode))
    return path


def _write_in_place(target: Path, data: bytes, what: str, shown: Path) -> None:
    try:
        with open(target, "wb") as handle:
            handle.write(data)
            handle.flush()
    except OSError as exc:
        raise _error(what, shown, exc) from None


def _replace(target: Path, data: bytes, what: str, shown: Path, mode: int | None) -> None:
    """Temporary file beside `target`, fsynced, renamed over it; the temporary file never outlives a failure."""
    temporary = None
    try:
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, mode if mode is not None else 0o666 & ~_umask())
        os.replace(temporary, target)
        temporary = None
        _fsync_directory(target.parent)
    except OSError as exc:
        raise _error(what, shown, exc) from None
    finally:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable; some file systems refuse to open a directory: the rename stands."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _error(what: str, path: Path, exc: OSError) -> MeshplanError:
    reason = exc.strerror or str(exc) or type(exc).__name__
    return MeshplanError(f"cannot write {what} {path}: {reason}; the previous file, if any, is unchanged "
                         "(free space, or choose a writable --out)")


def refuse_output_over_input(out_flag: str, out: str | None, inputs) -> None:
    """Refuse (MeshplanError, before anything is written or deleted) an output that is one of the
    command's input files: `inputs` are (flag, path or None) pairs. Compared by file identity when
    both exist (a symlink or another spelling of the same path is the same file), else by real path."""
    if not out:
        return
    for flag, path in inputs:
        if path and _same_file(out, path):
            raise MeshplanError(f"{out_flag} {out} is the {flag} input {path}; writing it would destroy that input: "
                                f"choose another {out_flag}")


def _same_file(first: str, second: str) -> bool:
    try:
        return os.path.samefile(first, second)
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(first) == os.path.realpath(second)
