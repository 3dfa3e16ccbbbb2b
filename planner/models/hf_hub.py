"""Where an `hf:` spec's config.json is: a file, a directory holding one, or a Hugging Face hub repository.

`hf:path/config.json` and `hf:dir/` name local files. Anything else that reads as a hub repository
id (`hf:meta-llama/Llama-3.1-8B`, `hf:gpt2`, optionally `@revision`) and names no local path is the
config.json of that repository: taken from the local Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`)
when it is there, else downloaded into it (that one file, a few KB; no weights), once per process.
`HF_HUB_OFFLINE=1` keeps meshplan on the cache, and `HF_TOKEN` (or `hf auth login`) opens gated
repositories, as for every Hugging Face tool. Every failure is one line naming the fix.

The plan keeps the spec as written (`hf:org/name`), so a plan made on one machine resolves on another
through that machine's cache; its model digest is the config's bytes, so a changed revision is noticed.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from meshplan.planner.contracts.errors import MeshplanError

# A hub repository id: `name` or `owner/name` (letters, digits, '-', '_', '.'), optionally `@revision`.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@(?P<revision>[\w./-]+))?")
CONFIG_NAME = "config.json"
LOCAL_FALLBACK = "or pass hf:path/config.json (a config file, no weights)"


def config_file(path_text: str) -> str:
    """The config file an `hf:` spec's text names: the path itself, `config.json` inside it when it
    is a directory, or the hub repository's config.json (`hub_config_file`) when the text is a
    repository id and no local path."""
    path = Path(path_text)
    if path.is_dir():
        return str(path / CONFIG_NAME)
    return path_text if is_local_path(path_text) else hub_config_file(path_text)


def is_local_path(path_text: str) -> bool:
    """Whether an `hf:` spec's text names a local file or directory: one that exists, or text that
    cannot be a hub repository id (the read then says the file is missing)."""
    return Path(path_text).exists() or not is_hub_id(path_text)


def is_hub_id(text: str) -> bool:
    """Whether `text` reads as a hub repository id rather than a file: `name` or `owner/name`
    (with an optional `@revision`), not ending in `.json`."""
    match = HUB_ID.fullmatch(text)
    return match is not None and not match["repo"].endswith(".json") and ".." not in match["repo"]


@functools.cache
def hub_config_file(text: str) -> str:
    """The local path of a hub repository's config.json: the cache's copy, else downloaded into the
    cache (one line on stderr says so first, since it may take a moment)."""
    match = HUB_ID.fullmatch(text)
    repo, revision = match["repo"], match["revision"]
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return hf_hub_download(repo, CONFIG_NAME, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        pass  # not cached: download it below
    except Exception as err:  # noqa: BLE001 - an invalid id or a broken cache entry: one line below
        raise _hub_error(text, repo, revision, err) from err
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise _uncached(text, repo, revision, "HF_HUB_OFFLINE is set")
    if not _hub_resolvable(constants.ENDPOINT):
        raise _uncached(text, repo, revision, f"{constants.ENDPOINT} cannot be resolved (no network)")
    print(f"meshplan: {CONFIG_NAME} of {text} is not in the local Hugging Face cache; downloading it "
          f"(a few KB, no weights; HF_HUB_OFFLINE=1 keeps meshplan offline)", file=sys.stderr)
    quiet = logging.getLogger("huggingface_hub")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its retries would print a warning each
    try:
        return hf_hub_download(repo, CONFIG_NAME, revision=revision)
    except Exception as err:  # noqa: BLE001 - every hub failure becomes one line naming the fix
        raise _hub_error(text, repo, revision, err) from err
    finally:
        quiet.setLevel(level)


def _hub_error(text: str, repo: str, revision: str | None, err: Exception) -> MeshplanError:
    """The one-line error for a hub repository whose config.json cannot be had."""
    from huggingface_hub import errors

    if isinstance(err, errors.GatedRepoError):
        why = (f"the hub repository {text} is gated: accept its licence on huggingface.co and set HF_TOKEN "
               f"(or run `hf auth login`), {LOCAL_FALLBACK}")
    elif isinstance(err, (errors.RepositoryNotFoundError, errors.HFValidationError)):
        why = f"no local path or hub repository {text!r}: check the name, {LOCAL_FALLBACK}"
    elif isinstance(err, errors.RevisionNotFoundError):
        why = f"the hub repository {text} has no revision {revision!r}: check it, {LOCAL_FALLBACK}"
    elif isinstance(err, errors.RemoteEntryNotFoundError):
        why = f"the hub repository {text} has no {CONFIG_NAME}: name a transformers model, {LOCAL_FALLBACK}"
    elif isinstance(err, errors.LocalEntryNotFoundError):
        return _uncached(text, repo, revision, "the hub cannot be reached")
    else:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        why = f"cannot read {CONFIG_NAME} of the hub repository {text}: {first}; {LOCAL_FALLBACK}"
    return MeshplanError(why)


def _uncached(text: str, repo: str, revision: str | None, reason: str) -> MeshplanError:
    """Not in the cache and not downloadable (`reason`): how to put the config.json into this
    machine's cache, or do without it."""
    pinned = f" --revision {revision}" if revision else ""
    return MeshplanError(f"{CONFIG_NAME} of {text} is not in the local Hugging Face cache and {reason}: fetch it "
                         f"with network access (`hf download {repo} {CONFIG_NAME}{pinned}`, into this machine's "
                         f"HF_HOME), {LOCAL_FALLBACK}")


def _hub_resolvable(endpoint: str) -> bool:
    """Whether the hub's host name resolves here (or a proxy will resolve it): without a network,
    huggingface_hub would retry its request for most of a minute before failing."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    try:
        socket.getaddrinfo(urlparse(endpoint).hostname or "", 443)
    except (OSError, UnicodeError):
        return False
    return True
