"""A checkpoint root's directories: which are complete checkpoints, which one a load takes, the
newest N kept, and the temporary directories of saves whose process is gone."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import warnings

import psutil

from engine.checkpointing.manifest import MANIFEST, read_manifest
from engine.checkpointing.processes import process_space
from heads.errors import CheckpointError

STEP_PREFIX = "global_step_"
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
#: A save's temporary directory (and the aside name of a replaced checkpoint of the same step).
_STAGING_DIR = re.compile(
    rf"^\.tmp-{STEP_PREFIX}(?P<step>\d+)-(?P<space>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}(-replaced)?$"
)


def staging_directory(root: str, global_step: int) -> str:
    """A new name for the temporary directory of this process's save of ``global_step``."""
    owner = f"{process_space()}-{os.getpid()}"
    return os.path.join(root, f".tmp-{STEP_PREFIX}{global_step}-{owner}-{secrets.token_hex(4)}")


def keep_newest(root: str, count: int) -> None:
    """Delete every complete checkpoint under ``root`` but the newest ``count``."""
    for _, old in complete_checkpoints(root)[:-count]:
        shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``global_step_*`` directory with a readable manifest, oldest
    first (temporary and manifest-less directories are not checkpoints)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match is None or not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        try:
            read_manifest(path)
        except CheckpointError:
            continue
        found.append((int(match.group(1)), path))
    return sorted(found)


def remove_abandoned_saves(root: str) -> list[str]:
    """Delete the temporary directories of saves whose process is gone (killed mid-save): each
    one's name carries the saving host, its pid namespace and the process id; a live process's
    save, or another host's or container's, is never touched. Returns the paths removed."""
    space, removed = process_space(), []
    for name in os.listdir(root):
        match = _STAGING_DIR.match(name)
        if match is None or match["space"] != space or psutil.pid_exists(int(match["pid"])):
            continue
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory itself, or a root's newest complete checkpoint."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MANIFEST}: the save did not finish); "
            "load its root to get the newest complete one"
        )
    complete = complete_checkpoints(path)
    if not complete:
        raise CheckpointError(
            f"no complete checkpoint under {path} (looked for {STEP_PREFIX}<N>/ directories "
            f"holding a valid {MANIFEST})"
        )
    newest, chosen = complete[-1]
    for name in sorted(os.listdir(path)):
        match = _STEP_DIR.match(name)
        staged = _STAGING_DIR.match(name)
        if match is not None and int(match.group(1)) > newest:
            warnings.warn(
                f"skipping {os.path.join(path, name)}: it is not a complete checkpoint (no valid "
                f"{MANIFEST}); loading the newest complete one, {chosen}",
                stacklevel=2,
            )
        elif staged is not None and not name.endswith("-replaced") and int(staged["step"]) > newest:
            warnings.warn(
                f"skipping the save of step {staged['step']} in {os.path.join(path, name)}: "
                "it did not finish (interrupted, or still being written); loading the "
                f"newest complete checkpoint, {chosen}",
                stacklevel=2,
            )
    return chosen
