"""Asynchronous saves: the state staged in the call, the files written and the directory published
by a background thread; a process exit waits for it."""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.checkpointing.manifest import describe
from engine.checkpointing.processes import is_alive
from engine.checkpointing.save import (
    WRITE_FAILURES,
    begin_save,
    kill_point,
    publish_checkpoint,
    written_everywhere,
)
from heads.errors import CheckpointError
from strategies.backends.base import AsyncCheckpointing, StagedSave
from strategies.checkpoint_files.publish import FileChecksums
from strategies.parallel.collectives import collective_timeout, merged_dicts, rank


def start_async_save(
    state: AsyncCheckpointing,
    engine: Mapping[str, Any],
    root: str,
    global_step: int,
    max_ckpt_to_keep: int | None,
) -> AsyncSave:
    """:func:`~engine.checkpointing.save.save_checkpoint`, returning once the state is staged
    (collective: planning, and the state copied out of the model and optimizer); a background thread
    writes the files. Every rank's thread leaves a marker in the temporary directory when its files
    are on disk; rank 0's then finishes the save, writes the manifest and publishes the directory,
    as a synchronous save does (no collectives in the background). Before its next save or load
    every rank calls :func:`finish_async_save`; a process exit waits for it too."""
    target, staging = begin_save(root, global_step, max_ckpt_to_keep, engine)
    staged: StagedSave | None = None
    try:
        staged, failure = state.stage_state(staging), None
    except WRITE_FAILURES as raised:
        failure = raised
    _, savers = written_everywhere(target, staging, {}, failure)  # none waits for a failed one
    assert staged is not None
    description = describe(engine, global_step)
    return AsyncSave(staged, staging, target, description, max_ckpt_to_keep, savers)


def finish_async_save(save: AsyncSave) -> str:
    """Wait for ``save`` (collective); CheckpointError on every rank if any rank's part or the
    publishing failed. Returns the published directory."""
    error = save.wait()
    try:
        errors = merged_dicts({str(rank()): error} if error is not None else {})
    except RuntimeError as failure:  # a rank is gone (the backends' errors derive from it)
        lost = f"cannot write the checkpoint {save.target}: a rank is gone ({failure})"
        raise CheckpointError(error or lost) from failure
    if errors:
        raise CheckpointError(errors.get("0") or next(iter(errors.values())))
    return save.target


class AsyncSave:
    """A save in flight (see :func:`start_async_save`): this rank's background thread."""

    def __init__(
        self,
        staged: StagedSave,
        staging: str,
        target: str,
        description: dict[str, Any],
        max_ckpt_to_keep: int | None,
        savers: Sequence[tuple[str, int]],
    ) -> None:
        self.target = target
        self._error: str | None = None
        peers = (rank(), savers, collective_timeout())
        self._thread = threading.Thread(
            target=self._run,
            args=(staged, staging, description, max_ckpt_to_keep, *peers),
            name=f"checkpoint-save-{os.path.basename(target)}",
        )
        _IN_FLIGHT.add(self)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str | None:
        """Block until this rank's part (on rank 0: the whole save) is done; its error, if any
        (rank 0's names any rank that failed)."""
        self._thread.join()
        _IN_FLIGHT.discard(self)
        return self._error

    def _run(
        self,
        staged: StagedSave,
        staging: str,
        description: dict[str, Any],
        max_ckpt_to_keep: int | None,
        this_rank: int,
        savers: Sequence[tuple[str, int]],
        peer_timeout: float,
    ) -> None:
        try:
            outcome: tuple[FileChecksums, Any] | str = staged.write()
            kill_point("after_state")
        except WRITE_FAILURES as failure:
            outcome = f"rank {this_rank} could not write its files: {failure!r}"
            self._error = f"cannot write the checkpoint {self.target}: {outcome}"
        if this_rank != 0:
            try:
                _write_marker(staging, this_rank, outcome)
            except OSError as failure:
                self._error = f"cannot write the checkpoint {self.target}: {failure}"
            return
        try:
            deadline = time.monotonic() + peer_timeout
            parts = [outcome]
            for peer in range(1, len(savers)):
                parts.append(_read_marker(staging, peer, savers[peer], deadline, peer_timeout))
            failed = [part for part in parts if isinstance(part, str)]
            if failed:
                raise CheckpointError("; ".join(failed))
            written = [part for part in parts if not isinstance(part, str)]
            staged.finish([result for _, result in written])
            checksums = {name: entry for files, _ in written for name, entry in files.items()}
            self._error = publish_checkpoint(
                staging, self.target, description, checksums, max_ckpt_to_keep
            )
        except WRITE_FAILURES as failure:
            self._error = f"cannot write the checkpoint {self.target}: {failure}"
        if self._error is not None:
            shutil.rmtree(staging, ignore_errors=True)


#: Saves whose thread nobody has waited for yet (a process exit waits for them).
_IN_FLIGHT: set[AsyncSave] = set()
_MARKER = ".written-rank-{}"


@atexit.register
def _wait_at_exit() -> None:
    """A process exits only once its in-flight saves are done. If one failed, the process
    reports it and ends with status 1: an exception raised in an exit handler is printed,
    "ignored", and leaves the exit status 0, so a job whose last checkpoint was lost would
    look successful. Exit handlers registered before this module was imported (before the
    first checkpoint save) then do not run; logging is flushed."""
    errors = [error for save in list(_IN_FLIGHT) if (error := save.wait()) is not None]
    if not errors:
        return
    print(f"CheckpointError: {'; '.join(errors)}", file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


def _write_marker(staging: str, this_rank: int, outcome: Any) -> None:
    """This rank's part of an asynchronous save (or why it failed), for rank 0's thread: the
    marker's existence says that the rank's files are on disk."""
    path = os.path.join(staging, _MARKER.format(this_rank))
    with open(f"{path}.partial", "wb") as handle:
        pickle.dump(outcome, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(f"{path}.partial", path)


def _read_marker(
    staging: str, peer: int, saver: tuple[str, int], deadline: float, timeout: float
) -> Any:
    """Wait for the marker of ``peer`` (whose process is ``saver``: space, pid) until
    ``deadline`` (``time.monotonic()``: rank 0 waits for all its peers as long as a collective
    would, ``timeout``), or until that process is seen gone; its content (the marker is
    removed: not a checkpoint file)."""
    path = os.path.join(staging, _MARKER.format(peer))
    while not os.path.exists(path):
        if not is_alive(*saver) and not os.path.exists(path):
            raise CheckpointError(
                f"rank {peer} (process {saver[1]} on this host) ended before writing its files"
            )
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank {peer} did not finish writing its files within {timeout:.0f} s "
                "(the process group's timeout): it failed or died"
            )
        time.sleep(0.01)
    with open(path, "rb") as handle:
        outcome = pickle.load(handle)
    os.remove(path)
    return outcome
