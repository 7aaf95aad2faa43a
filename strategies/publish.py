"""Publishing a directory whole: write it under a temporary name, then rename it into place, so
a reader never sees a half-written checkpoint (engine checkpoints and Hugging Face exports)."""

from __future__ import annotations

import os
import shutil

from heads.errors import CheckpointError


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file or directory to stable storage."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish_directory(staging: str, target: str) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is replaced (moved aside first,
    removed after). CheckpointError when the file system refuses."""
    aside = f"{staging}-replaced"
    try:
        if os.path.exists(target):
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(target, aside)
        os.rename(staging, target)
        fsync_path(os.path.dirname(os.path.abspath(target)))
    except OSError as error:
        raise CheckpointError(
            f"cannot move the checkpoint into place at {target}: {error}"
        ) from error
    shutil.rmtree(aside, ignore_errors=True)
