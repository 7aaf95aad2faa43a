"""``torch.distributed.checkpoint`` saves written by the saving process itself, checksummed as
the bytes go out, and split for asynchronous saves into a collective *staging* part (planning,
and every tensor copied out of the live state into host buffers kept between saves) and a
*write* that needs no other rank (``strategies.backends.base.StagedSave``).

The files are DCP's own (one ``__{rank}_0.distcp`` per rank, rank 0's ``.metadata`` naming where
each item went), so ``dcp.load`` and any DCP reader read them. Megatron's writer
(``strategies.backends.megatron.checkpoint_writer``) shares the item writing and the buffers.

Imported by checkpoint code only (it imports torch's DCP).
"""

from __future__ import annotations

import inspect
import io
import os
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from strategies.checkpoint_files.publish import ChecksummedFile, FileChecksums
from strategies.parallel.collectives import from_rank_zero, merged_dicts, rank

#: Each item as ``torch.save`` bytes, what DCP's and megatron's loaders expect (torch >= 2.7
#: asks).
ITEM_FORMAT: dict[str, Any] = {}
if "serialization_format" in inspect.signature(_write_item).parameters:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    ITEM_FORMAT["serialization_format"] = SerializationFormat.TORCH_SAVE

#: What an item is written from: a tensor, or bytes already serialised.
ItemData = torch.Tensor | io.BytesIO


def write_checksummed(
    path: str, storage_key: str, transforms: Any, items: Iterable[tuple[WriteItem, ItemData]]
) -> tuple[list[WriteResult], dict[str, Any]]:
    """Write ``items`` into the new file ``path`` (known to the metadata as ``storage_key``),
    flushed to stable storage; where each item went, and the file's size and checksum."""
    with ChecksummedFile(path) as stream:
        results = [
            _write_item(transforms, stream, _on_cpu(data), item, storage_key, **ITEM_FORMAT)
            for item, data in items
        ]
        stream.sync()
    return results, stream.entry()


def copy_to_host(
    tensors: Iterable[tuple[WriteItem, torch.Tensor]],
    buffers: dict[Any, torch.Tensor],
    used: dict[Any, torch.Tensor],
) -> list[tuple[WriteItem, torch.Tensor]]:
    """Each item's tensor copied into its host buffer from ``buffers`` (made where missing or of
    another shape: copying into memory already touched is several times faster than into fresh
    pages); the buffers used are added to ``used``, which the caller keeps for its next save."""
    copies = []
    for item, tensor in tensors:
        name = (item.index.fqn, tuple(item.index.offset or ()))
        buffer = buffers.get(name)
        if buffer is None or (buffer.shape, buffer.dtype) != (tensor.shape, tensor.dtype):
            buffer = torch.empty_like(tensor, device="cpu")
        used[name] = buffer.copy_(tensor.detach())
        copies.append((item, used[name]))
    return copies


@attrs.frozen
class StagedDcpSave:
    """This rank's file of a planned DCP save, its items staged in host memory
    (``strategies.backends.base.StagedSave``); ``metadata`` on rank 0 only."""

    writer: FileSystemWriter
    #: The file's name, and where the checkpoint's manifest finds it (relative to the save).
    file_name: str
    relative_path: str
    items: list[tuple[WriteItem, ItemData]]
    metadata: Metadata | None

    def write(self) -> tuple[FileChecksums, list[WriteResult]]:
        path = os.path.join(os.fspath(self.writer.path), self.file_name)
        results, entry = write_checksummed(path, self.file_name, self.writer.transforms, self.items)
        return {self.relative_path: entry}, results

    def finish(self, parts: Sequence[list[WriteResult]]) -> None:
        """On rank 0: DCP's ``.metadata``, where every rank's items went."""
        if self.metadata is None:
            raise RuntimeError("finish() on a rank that did not plan the save")
        self.writer.finish(self.metadata, list(parts))


def stage_dcp_save(
    state: dict[str, Any], path: str, relative: str, buffers: dict[Any, torch.Tensor] | None
) -> StagedDcpSave:
    """Plan the DCP save of ``state`` into the directory ``path`` (``relative``: that directory
    inside the checkpoint) as ``dcp.save`` does (collective: every rank's plan to rank 0, the
    global plan back) and copy this rank's tensors into ``buffers`` (host memory kept between
    saves; afterwards it holds only the buffers of this save); ``buffers`` None: the save
    writes the live tensors (a synchronous save, written at once: :func:`save_dcp`)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    coordinator = rank() == 0
    writer = FileSystemWriter(path)
    planner = DefaultSavePlanner()
    planner.set_up_planner(
        state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=coordinator
    )
    writer.set_up_storage_writer(coordinator, rank=rank(), use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    by_rank = merged_dicts({str(rank()): local})
    plans: list[SavePlan] | None = None
    metadata: Metadata | None = None
    if coordinator:
        ranks = sorted(by_rank, key=int)
        plans, metadata = planner.create_global_plan([by_rank[key] for key in ranks])
        plans = writer.prepare_global_plan(plans)
    plans = from_rank_zero(plans)
    assert plans is not None
    plan = planner.finish_plan(plans[rank()])
    resolved = [(item, planner.resolve_data(item)) for item in plan.items]
    tensors = [(item, data) for item, data in resolved if isinstance(data, torch.Tensor)]
    used: dict[Any, torch.Tensor] = {}
    items: list[tuple[WriteItem, ItemData]] = [
        (item, data) for item, data in resolved if not isinstance(data, torch.Tensor)
    ]
    if buffers is None:
        items += tensors
    else:
        items += copy_to_host(tensors, buffers, used)
        buffers.clear()
        buffers.update(used)
    file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
    return StagedDcpSave(
        writer=writer,
        file_name=file_name,
        relative_path=f"{relative}/{file_name}",
        items=items,
        metadata=metadata,
    )


def save_dcp(state: dict[str, Any], path: str, relative: str) -> FileChecksums:
    """``dcp.save`` of ``state`` into ``path`` (collective), written as an asynchronous save's
    files are (:func:`write_checksummed`: checksummed as the bytes go out, flushed to disk while
    writing, every tensor from its own memory); the size and checksum of this rank's file."""
    staged = stage_dcp_save(state, path, relative, None)
    failure: Exception | None = None
    try:
        checksums, results = staged.write()
    except Exception as error:  # every rank raises, as dcp.save does, instead of waiting
        checksums, results, failure = {}, [], error
    report = None if failure is None else f"rank {rank()} could not write its file: {failure!r}"
    everyone = merged_dicts({str(rank()): (report, results)})
    failures = [failed for failed, _ in everyone.values() if failed is not None]
    if failure is not None:
        raise failure
    if failures:
        raise OSError("; ".join(failures))
    if rank() == 0:
        staged.finish([everyone[key][1] for key in sorted(everyone, key=int)])
    return checksums


def _on_cpu(data: ItemData) -> ItemData:
    if isinstance(data, torch.Tensor):
        return own_storage(data.to("cpu") if data.device.type != "cpu" else data)
    return data


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself on a storage of exactly its bytes, sharing its memory (no copy), where
    it is a contiguous host view into a larger storage (a weight in megatron's or FSDP2's flat
    buffers); otherwise ``tensor``. ``torch.save``, which writes each item, writes a tensor's
    whole storage: a view would write the whole buffer, and megatron's writer clones every view
    before writing (the whole model and optimizer state copied once more, measured at 0.5B
    parameters: a fifth of a save and 6 GB)."""
    size = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu" or storage.nbytes() == size or not tensor.is_contiguous():
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    alias = torch.empty(0, dtype=tensor.dtype)
    return alias.set_(storage[start : start + size], 0, tensor.shape, tensor.stride())
