"""Loading a checkpoint: the directory resolved and verified on rank 0, then the state restored
on every rank."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from engine.checkpointing.manifest import (
    changed_settings,
    check_compatible,
    describe,
    read_manifest,
    verify_files,
)
from engine.checkpointing.retention import resolve_checkpoint
from heads.errors import CheckpointError
from strategies.backends.base import Checkpointing
from strategies.parallel.collectives import from_rank_zero, rank


def load_checkpoint(
    state: Checkpointing, engine: Mapping[str, Any], path: str
) -> tuple[str, int, dict[str, Any]]:
    """Verify, then restore into ``state`` the checkpoint at ``path`` (a root: its newest
    complete checkpoint; or one ``global_step_*`` directory) saved by an engine like
    ``engine`` (see :func:`~engine.checkpointing.save.save_checkpoint`). Collective; returns the
    directory loaded, its global step and the non-finite guard's counters it recorded (empty when it
    has none)."""
    found: tuple[str, dict[str, Any]] | str | None = None
    if rank() == 0:
        try:
            directory = resolve_checkpoint(os.fspath(path))
            manifest = read_manifest(directory)
            check_compatible(directory, manifest, describe(engine, 0))
            verify_files(directory, manifest)
            found = (directory, manifest)
        except (CheckpointError, OSError) as error:  # every rank raises, none waits for rank 0
            found = str(error)
    found = from_rank_zero(found)
    if isinstance(found, str) or found is None:
        raise CheckpointError(found)
    directory, manifest = found
    state.load_state(directory, same_layout=manifest.get("parallel") == engine["parallel"])
    changed = changed_settings(manifest.get("config"), engine["config"])
    if changed and rank() == 0:
        warnings.warn(
            f"resuming {directory} with settings changed since it was saved; this engine's "
            f"apply from the resumed step on: {', '.join(changed)}",
            stacklevel=3,
        )
    guard = manifest.get("non_finite")
    return directory, int(manifest["global_step"]), dict(guard) if isinstance(guard, dict) else {}
