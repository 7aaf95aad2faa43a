"""Megatron's torch_dist save, written by the saving process itself: each rank writes its
shards to one file and checksums the bytes as they go out (no second pass over the file).

Megatron's own write step forks a helper process per file for every save, and the engine
then read every file back to checksum it; on a CPU host both cost more than the writing.
Planning, the file format, the metadata and finalisation stay megatron's, so any megatron
load strategy reads the result.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.filesystem import _write_item

from strategies.publish import ChecksummedFile, FileChecksums

#: Each item as ``torch.save`` bytes, what megatron's loader expects (torch >= 2.7 asks).
_ITEM_FORMAT: dict[str, Any] = {}
if "serialization_format" in inspect.signature(_write_item).parameters:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    _ITEM_FORMAT["serialization_format"] = SerializationFormat.TORCH_SAVE


class ChecksummingSaveStrategy(TorchDistSaveShardedStrategy):
    """torch_dist saves, one file per rank written in this process (see the module).
    ``checksums`` holds what the latest write produced. Megatron's plan caching
    (``cached_metadata``) is left off: it saved ~10 ms a save here and reuses a plan without
    checking the state's structure."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, thread_count=1)
        self.checksums: FileChecksums = {}

    def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any) -> Any:
        request: AsyncRequest = super()._get_save_and_finalize_callbacks(
            writer, save_state_dict_ret
        )
        self.checksums = {}
        if request.async_fn is None:  # nothing to write on this rank
            return request
        return request._replace(
            async_fn=self._write, async_fn_args=(writer,), async_fn_kwargs={}, preload_fn=None
        )

    def _write(self, writer: FileSystemWriterAsync) -> None:
        """Megatron's write step for ``writer``'s buckets, here, checksumming each file; the
        results go where megatron's finalisation reads them."""
        results: dict[int, Any] = {}
        try:
            for index, (path, key, (bytes_data, tensor_data)) in enumerate(writer.write_buckets):
                with ChecksummedFile(path) as stream:
                    results[index] = [
                        _write_item(writer.transforms, stream, data, item, key, **_ITEM_FORMAT)
                        for item, data in [*bytes_data, *[(i, _on_cpu(t)) for i, t in tensor_data]]
                    ]
                    stream.sync()
                self.checksums[os.path.basename(path)] = stream.entry()
        except Exception as error:  # megatron's finalisation raises it on every rank
            writer.results_queue.put(error)
            return
        writer.results_queue.put(results)


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")
