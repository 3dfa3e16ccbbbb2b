"""Checkpoint manifests: which run wrote a checkpoint, and the SHA-256 of every file in it.

`DIR/step_N/COMPLETE` is the manifest, written last (atomically, after every rank's shards and
only when the saved state is finite). It names the run (`RunIdentity`: a run id chosen at the
first start, the plan digest, the seed, the model digest) and lists each file with its size and
SHA-256. A checkpoint is loaded only after every listed file hashes to its manifest entry: DCP's
`.metadata` is a pickle, so it must not be read (unpickled) before its bytes are vouched for.

Nothing here imports torch: the launcher chooses and verifies the checkpoint to resume from
before any worker starts, and the tests call these functions directly.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER = "COMPLETE"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a few files per rank: anything larger is not one
_CHUNK_BYTES = 1 << 20


class CheckpointInvalid(Exception):
    """A checkpoint failed verification; the message is one line naming the file and the cause."""


@dataclass(frozen=True)
class RunIdentity:
    """What makes a checkpoint this run's: resuming another run's state would report its losses as ours."""

    run_id: str
    plan_digest: str
    seed: int
    model_digest: str

    def __post_init__(self):
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError(f"run_id must be a non-empty string, got {self.run_id!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def differences(self, other: "RunIdentity") -> list[str]:
        """What differs besides the run id (the seed, the plan, the model), in words."""
        found = []
        if self.seed != other.seed:
            found.append(f"seed {self.seed}, this run {other.seed}")
        if self.plan_digest != other.plan_digest:
            found.append(f"plan {self.plan_digest}, this run {other.plan_digest}")
        if self.model_digest != other.model_digest:
            found.append(f"model digest {self.model_digest[:12]}, this run {other.model_digest[:12]}")
        return found


@dataclass(frozen=True)
class FileEntry:
    name: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    identity: RunIdentity
    files: tuple[FileEntry, ...]

    def __post_init__(self):
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 1:
            raise ValueError(f"step must be a positive integer, got {self.step!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        for entry in self.files:  # names are plain file names inside the checkpoint: no path escapes
            if not entry.name or "/" in entry.name or entry.name in (".", "..", MARKER):
                raise ValueError(f"file name {entry.name!r} is not a file of the checkpoint")

    def to_json(self) -> dict:
        return {"manifest_version": MANIFEST_VERSION, "step": self.step, "world_size": self.world_size,
                "identity": asdict(self.identity), "files": [asdict(entry) for entry in self.files]}


def manifest_from_json(data) -> Manifest:
    if not isinstance(data, dict) or data.get("manifest_version") != MANIFEST_VERSION:
        raise ValueError(f"not a meshplan manifest (manifest_version {MANIFEST_VERSION} expected)")
    try:
        files = tuple(FileEntry(name=str(item["name"]), size_bytes=int(item["size_bytes"]),
                                sha256=str(item["sha256"])) for item in data["files"])
        return Manifest(step=data["step"], world_size=data["world_size"],
                        identity=RunIdentity(**data["identity"]), files=files)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed manifest ({type(exc).__name__}: {exc})") from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(path: Path) -> tuple[FileEntry, ...]:
    """Every regular file DCP wrote in `path` (not the manifest, nor temporary files), hashed."""
    names = sorted(child.name for child in path.iterdir()
                   if child.is_file() and child.name != MARKER and not child.name.startswith(f".{MARKER}"))
    return tuple(FileEntry(name, (path / name).stat().st_size, sha256_file(path / name)) for name in names)


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Atomically: the manifest is either absent or whole (temp file, fsync, rename, fsync dir)."""
    temporary = path / f".{MARKER}.tmp"
    with open(temporary, "w") as handle:
        handle.write(json.dumps(manifest.to_json()))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path / MARKER)
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_manifest(path: Path) -> Manifest:
    """The manifest of checkpoint `path`; CheckpointInvalid (one line) when absent or malformed."""
    marker = path / MARKER
    try:
        if marker.stat().st_size > MAX_MANIFEST_BYTES:
            raise CheckpointInvalid(f"{marker} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")
        return manifest_from_json(json.loads(marker.read_text()))
    except OSError as exc:
        raise CheckpointInvalid(f"{marker} cannot be read ({exc.strerror or type(exc).__name__})") from None
    except ValueError as exc:  # JSONDecodeError and the contract's checks
        raise CheckpointInvalid(f"{marker} is not a valid manifest ({' '.join(str(exc).split())})") from None


def verify(path: Path) -> Manifest:
    """The manifest, after every file it lists has its size and SHA-256 (read in full, never unpickled)."""
    manifest = read_manifest(path)
    for entry in manifest.files:
        file = path / entry.name
        try:
            size_bytes = file.stat().st_size
            if size_bytes != entry.size_bytes:
                raise CheckpointInvalid(f"{entry.name} holds {size_bytes} bytes, its manifest says {entry.size_bytes}")
            if sha256_file(file) != entry.sha256:
                raise CheckpointInvalid(f"the SHA-256 of {entry.name} differs from its manifest")
        except OSError as exc:
            raise CheckpointInvalid(f"{entry.name} cannot be read ({exc.strerror or type(exc).__name__})") from None
    if not any(entry.name == ".metadata" for entry in manifest.files):
        raise CheckpointInvalid("its manifest lists no .metadata")
    return manifest


def checkpoints(directory: str | Path | None) -> list[tuple[int, Path]]:
    """(step, path) of every `step_N` holding a manifest file, newest first (nothing verified yet)."""
    if directory is None or not Path(directory).is_dir():
        return []
    found = [(int(child.name[5:]), child) for child in Path(directory).iterdir()
             if child.name.startswith("step_") and child.name[5:].isdigit() and (child / MARKER).is_file()]
    return sorted(found, reverse=True)


def newest_of_run(directory: str | Path | None, run_id: str) -> tuple[int, Path] | None:
    """The newest checkpoint whose manifest names `run_id` (manifests only: no hashing)."""
    for step, path in checkpoints(directory):
        try:
            if read_manifest(path).identity.run_id == run_id:
                return step, path
        except CheckpointInvalid:
            continue
    return None


@dataclass(frozen=True)
class Choice:
    """The checkpoint to load (None: start from step 0) and one line per checkpoint passed over."""

    path: Path | None
    manifest: Manifest | None
    notes: tuple[str, ...] = ()


def _skipped(path: Path, reason: str) -> str:
    return f"checkpoint {path} is not used: {reason}"


def newest_verified(candidates: list[tuple[int, Path]]) -> Choice:
    """The newest candidate that verifies, with a note for each newer one that did not."""
    notes = []
    for _, path in candidates:
        try:
            manifest = verify(path)
        except CheckpointInvalid as exc:
            notes.append(_skipped(path, str(exc)))
            continue
        return Choice(path, manifest, tuple(notes))
    return Choice(None, None, tuple(notes))


class OtherRunsCheckpoint(ValueError):
    """The checkpoint `--resume` would load was written by another run (other seed, plan or model)."""


def choose_for_resume(directory: str | Path, identity: RunIdentity) -> Choice:
    """`--resume`: the newest checkpoint in `directory` that verifies; refused (OtherRunsCheckpoint)
    when it belongs to another run, which only `--resume-from` can name."""
    choice = newest_verified(checkpoints(directory))
    if choice.manifest is not None:
        differences = choice.manifest.identity.differences(identity)
        if differences:
            raise OtherRunsCheckpoint(
                f"the newest checkpoint, {choice.path}, was written by another run ({'; '.join(differences)}); "
                f"to start from it anyway pass --resume-from {choice.path}, else use another --checkpoint-dir")
    return choice


def choose_explicit(path: str | Path) -> Choice:
    """`--resume-from PATH`: that checkpoint (`DIR/step_N`), or the newest one that verifies in a
    checkpoint directory, whatever run wrote it. A named checkpoint that fails verification is an error."""
    path = Path(path)
    if (path / MARKER).is_file():
        try:
            return Choice(path, verify(path))
        except CheckpointInvalid as exc:
            raise CheckpointInvalid(_skipped(path, str(exc))) from None
    choice = newest_verified(checkpoints(path))
    if choice.path is None:
        raise CheckpointInvalid(f"--resume-from {path} holds no checkpoint that verifies"
                                + (f" ({choice.notes[0]})" if choice.notes else ""))
    return choice


def choose_for_restart(directory: str | Path | None, run_id: str) -> Choice:
    """After torchrun restarted the workers: the newest checkpoint of this run that verifies;
    checkpoints of other runs in the same directory are never adopted."""
    own = []
    for step, path in checkpoints(directory):
        try:
            if read_manifest(path).identity.run_id == run_id:
                own.append((step, path))
        except CheckpointInvalid:
            continue  # another run's or a broken manifest: never this run's
    return newest_verified(own)
