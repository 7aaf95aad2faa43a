"""A synchronous save, and the steps an asynchronous one shares with it: the temporary directory,
every rank's part agreed on, the manifest written and the directory published."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from engine.checkpointing.manifest import (
    describe,
    is_count,
    taken_by_another_engine,
    write_manifest,
)
from engine.checkpointing.processes import process_space
from engine.checkpointing.retention import (
    STEP_PREFIX,
    keep_newest,
    remove_abandoned_saves,
    staging_directory,
)
from heads.errors import CheckpointError, ConfigError
from strategies.backends.base import Checkpointing
from strategies.checkpoint_files.publish import FileChecksums, publish_directory
from strategies.parallel.collectives import from_rank_zero, merged_dicts, rank

#: Test hook: the saving process SIGKILLs itself when it reaches the named stage
#: (``after_state``, ``before_manifest``, ``before_rename``).
KILL_AT_ENV = "COMPOSABLE_ENGINE_CHECKPOINT_KILL_AT"
#: What a failed write raises: torch's ``CheckpointException`` (megatron's too) is a
#: BaseException, which ``except Exception`` lets through.
WRITE_FAILURES = (Exception, CheckpointException)


def save_checkpoint(
    state: Checkpointing,
    engine: Mapping[str, Any],
    root: str,
    global_step: int,
    max_ckpt_to_keep: int | None,
) -> str:
    """Write ``state`` to ``root/global_step_{global_step}`` (collective); ``engine`` describes
    the engine (``head``, ``backend``, ``model``, ``parallel``, ``config``). Returns the path."""
    target, staging = begin_save(root, global_step, max_ckpt_to_keep, engine)
    try:
        written, failure = state.save_state(staging) or {}, None
    except WRITE_FAILURES as raised:
        written, failure = {}, raised
    written, _ = written_everywhere(target, staging, written, failure)
    kill_point("after_state")
    error = None
    if rank() == 0:
        error = publish_checkpoint(
            staging, target, describe(engine, global_step), written, max_ckpt_to_keep
        )
    error = from_rank_zero(error)
    if error is not None:
        raise CheckpointError(error)
    return target


def written_everywhere(
    target: str, staging: str, written: FileChecksums, failure: BaseException | None
) -> tuple[FileChecksums, list[tuple[str, int]]]:
    """Every rank's ``written`` merged, and each rank's saving process
    (:func:`~engine.checkpointing.processes.process_space`, pid), by rank (collective). If any
    rank's part of the save failed (``failure``), CheckpointError on every rank, naming each failed
    rank, and the temporary directory is removed."""
    report = None if failure is None else f"rank {rank()} could not write its files: {failure!r}"
    saver = (process_space(), os.getpid())
    parts = merged_dicts({str(rank()): (report, written, saver)})
    by_rank = [parts[key] for key in sorted(parts, key=int)]
    failed = [report for report, _, _ in by_rank if report is not None]
    if failed:
        if rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"cannot write the checkpoint {target}: {'; '.join(failed)}") from (
            failure
        )
    merged = {name: entry for _, files, _ in by_rank for name, entry in files.items()}
    return merged, [saver for _, _, saver in by_rank]


def begin_save(
    root: str, global_step: int, max_ckpt_to_keep: int | None, engine: Mapping[str, Any]
) -> tuple[str, str]:
    """The target directory and the temporary one a save writes (made by rank 0; collective)."""
    if not is_count(global_step) or global_step < 0:
        raise ConfigError(f"global_step must be an int >= 0; got {global_step!r}")
    if max_ckpt_to_keep is not None and (not is_count(max_ckpt_to_keep) or max_ckpt_to_keep < 1):
        raise ConfigError(f"max_ckpt_to_keep must be an int >= 1 or None; got {max_ckpt_to_keep!r}")
    root = os.path.abspath(os.fspath(root))
    target = os.path.join(root, f"{STEP_PREFIX}{global_step}")
    made: tuple[str, str | None] = ("", None)
    if rank() == 0 and (taken := taken_by_another_engine(target, engine)) is not None:
        made = ("", taken)
    elif rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            remove_abandoned_saves(root)
            staging = staging_directory(root, global_step)
            os.makedirs(staging)
            made = (staging, None)
        except OSError as error:
            made = ("", f"cannot write a checkpoint under {root}: {error}")
    staging, failure = from_rank_zero(made)
    if failure is not None:
        raise CheckpointError(failure)
    return target, staging


def publish_checkpoint(
    staging: str,
    target: str,
    description: dict[str, Any],
    written: FileChecksums,
    max_ckpt_to_keep: int | None,
) -> str | None:
    """On rank 0: manifest, rename into place, retention. Why it failed, or None."""
    try:
        kill_point("before_manifest")
        write_manifest(staging, description, written)
        kill_point("before_rename")
        publish_directory(staging, target)
        if max_ckpt_to_keep is not None:
            keep_newest(os.path.dirname(target), max_ckpt_to_keep)
    except (OSError, CheckpointError) as failure:
        return f"cannot write the checkpoint {target}: {failure}"
    return None


def kill_point(name: str) -> None:
    if os.environ.get(KILL_AT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
