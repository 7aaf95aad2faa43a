"""Megatron's torch_dist save, written by the saving process itself: each rank writes its
shards to one file and checksums the bytes as they go out (no second pass over the file).

Megatron's own write step forks a helper process per file for every save, and the engine
then read every file back to checksum it; on a CPU host both cost more than the writing.
Planning, the file format, the metadata and finalisation stay megatron's, so any megatron
load strategy reads the result.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.strategies import torch as megatron_torch_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from strategies.checkpoint_files.publish import FileChecksums
from strategies.checkpoint_files.staged_dcp import copy_to_host, own_storage, write_checksummed


class ChecksummingSaveStrategy(TorchDistSaveShardedStrategy):
    """torch_dist saves, one file per rank written in this process (see the module).
    ``checksums`` holds what the latest write produced. Megatron's plan caching
    (``cached_metadata``) is left off: it saved ~10 ms a save here and reuses a plan without
    checking the state's structure.

    Given ``staging_buffers``, ``dist_checkpointing.save(..., async_sharded_save=True)`` only
    plans (collective) and copies the tensors to write out of the live state into those
    buffers (by item; the caller keeps them for its next save: copying into memory already
    touched is several times faster than into fresh pages); :meth:`write_staged` (any thread,
    no collectives) and, on rank 0 with every rank's results, :meth:`finish_staged` do the
    rest."""

    def __init__(self, *, staging_buffers: dict[Any, torch.Tensor] | None = None) -> None:
        super().__init__("torch_dist", 1, thread_count=1)
        self.staged = staging_buffers is not None
        self._buffers = staging_buffers
        self.checksums: FileChecksums = {}
        self._writer: FileSystemWriterAsync | None = None
        self._global_metadata: Metadata | None = None

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> AsyncRequest:
        with _writer_of_own_storages():
            return super().async_save(sharded_state_dict, checkpoint_dir)

    def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any) -> Any:
        request: AsyncRequest = super()._get_save_and_finalize_callbacks(
            writer, save_state_dict_ret
        )
        self.checksums = {}
        self._writer, self._global_metadata = writer, save_state_dict_ret[1]
        if self._buffers is not None:
            writer.write_buckets = _staged(writer.write_buckets, self._buffers)
        if request.async_fn is None:  # nothing to write on this rank
            return request
        return request._replace(
            async_fn=self._write, async_fn_args=(writer,), async_fn_kwargs={}, preload_fn=None
        )

    def _write(self, writer: FileSystemWriterAsync) -> None:
        """Megatron's write step for ``writer``'s buckets, here; the results go where
        megatron's finalisation reads them."""
        try:
            results = self._write_buckets(writer)
        except Exception as error:  # megatron's finalisation raises it on every rank
            writer.results_queue.put(error)
            return
        writer.results_queue.put(results)

    def _write_buckets(self, writer: FileSystemWriterAsync) -> dict[int, list[WriteResult]]:
        """Write each bucket's file, checksumming it (into ``checksums``)."""
        results: dict[int, list[WriteResult]] = {}
        for index, (path, key, (bytes_data, tensor_data)) in enumerate(writer.write_buckets):
            results[index], entry = write_checksummed(
                path, key, writer.transforms, [*bytes_data, *tensor_data]
            )
            self.checksums[os.path.basename(path)] = entry
        return results

    def write_staged(self) -> list[WriteResult]:
        """This rank's file of a staged save; returns where each item went."""
        if self._writer is None:
            raise RuntimeError("write_staged() before a staged dist_checkpointing.save")
        return [r for part in self._write_buckets(self._writer).values() for r in part]

    def finish_staged(self, results: Sequence[list[WriteResult]]) -> None:
        """On rank 0: the index of every rank's items (``.metadata``), then megatron's
        ``metadata.json`` (what its loader checks first)."""
        if self._writer is None or self._global_metadata is None:
            raise RuntimeError("finish_staged() on a rank that did not plan the save")
        self._writer.finish(self._global_metadata, list(results))
        config = CheckpointingConfig(self.backend, self.version)
        save_config(config, str(self._writer.checkpoint_id))


class _OwnStorageWriter(FileSystemWriterAsync):
    """Megatron's writer, handed each tensor on a storage of its own bytes
    (``staged_dcp.own_storage``), so that it writes the live tensors instead of a clone of
    every one that is a view into a flat buffer (which is every weight and optimizer state)."""

    def prepare_write_data(self, plan: Any, planner: Any) -> None:
        super().prepare_write_data(plan, _OwnStorages(planner))


class _OwnStorages:
    """A save planner whose resolved tensors are on storages of their own bytes."""

    def __init__(self, planner: Any) -> None:
        self._planner = planner

    def resolve_data(self, item: Any) -> Any:
        data = self._planner.resolve_data(item)
        return own_storage(data) if isinstance(data, torch.Tensor) else data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


@contextlib.contextmanager
def _writer_of_own_storages() -> Iterator[None]:
    """Megatron's torch_dist strategy builds its writer by name in ``async_save``: for that
    call the name is :class:`_OwnStorageWriter`."""
    original = megatron_torch_strategy.FileSystemWriterAsync
    megatron_torch_strategy.FileSystemWriterAsync = _OwnStorageWriter
    try:
        yield
    finally:
        megatron_torch_strategy.FileSystemWriterAsync = original


def _staged(buckets: list[Any], buffers: dict[Any, torch.Tensor]) -> list[Any]:
    """``buckets`` with every tensor copied into its host buffer; ``buffers`` keeps only those
    used."""
    used: dict[Any, torch.Tensor] = {}
    staged = [
        (path, key, (bytes_data, copy_to_host(tensor_data, buffers, used)))
        for path, key, (bytes_data, tensor_data) in buckets
    ]
    buffers.clear()
    buffers.update(used)
    return staged
