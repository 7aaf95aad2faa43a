"""Megatron's torch_dist load, reading each file through one memory map: every stored tensor
is copied once, straight from the mapped file into the tensor it restores.

torch's ``FileSystemReader`` (which megatron's load uses) runs ``torch.load`` on every item:
a pure-Python unpickler, a copy of the bytes into a fresh tensor, then a second copy into the
target; that was two thirds of an engine load. Here an item's ``torch.save`` archive (an
uncompressed zip) is located in the mapping and its small pickle read by a C unpickler that
knows only the names a saved tensor refers to. An item in any other form (a transform, a
compressed or zip64 archive, a tensor subclass, another byte order) goes through
``torch.load`` as before, so any torch_dist checkpoint loads, whoever wrote it. Planning,
resharding and validation stay megatron's and torch's.
"""

from __future__ import annotations

import collections
import io
import mmap
import os
import pickle
import struct
import warnings
from pathlib import Path
from typing import Any, cast

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future
from torch.serialization import StorageType

_END_OF_DIRECTORY = struct.Struct("<IHHHHIIH")  # zip "end of central directory" record
_DIRECTORY_ENTRY = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_END_SIGNATURE, _ENTRY_SIGNATURE, _LOCAL_SIGNATURE = 0x06054B50, 0x02014B50, 0x04034B50


class _NotPlain(Exception):
    """An item this reader leaves to ``torch.load``."""


class MappedLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron's torch_dist load strategy with :class:`MappedFileSystemReader` as its reader
    (the body of megatron-core 0.16's ``TorchDistLoadShardedStrategy.load``, whose reader is
    not a parameter)."""

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
        flexible = [
            tensor
            for tensor in nested_values(sharded_state_dict)
            if isinstance(tensor, ShardedTensor) and not tensor.allow_shape_mismatch
        ]
        mismatch_allowed = {
            tensor.key: tensor
            for tensor in nested_values(sharded_state_dict)
            if isinstance(tensor, ShardedTensor) and tensor.allow_shape_mismatch
        }
        original = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = (
            _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        )
        reader = MappedFileSystemReader(checkpoint_dir)
        with warnings.catch_warnings():
            # megatron loads through torch's deprecated ShardedTensor, and torch warns for every
            # tensor: about megatron's internals, which no user of this engine can act on
            warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
            dcp_load(
                pyt_state_dict,
                storage_reader=reader,
                planner=MCoreLoadPlanner(
                    shapes_validation_sharded_tensors=flexible,
                    allow_shape_mismatch_sharded_tensors=mismatch_allowed,
                ),
            )
        self.cached_global_metadata = reader.read_metadata()
        state = {key: _unwrap_pyt_sharded_tensor(value) for key, value in pyt_state_dict.items()}
        state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
        _restore_dict_types(state, original)
        return state


class MappedFileSystemReader(CachedMetadataFileSystemReader):
    """A DCP file reader that maps each file once and copies each tensor into its target."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative_path, items in per_file.items():
            path = os.path.join(self.path, relative_path)
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                # A private (copy-on-write) mapping: writable as torch.frombuffer wants, never
                # written.
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
            file_bytes = torch.frombuffer(mapped, dtype=torch.uint8) if mapped else None
            for item in items:
                self._read_item(item, planner, mapped, file_bytes)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(
        self,
        item: ReadItem,
        planner: LoadPlanner,
        mapped: mmap.mmap | None,
        file_bytes: torch.Tensor | None,
    ) -> None:
        stored = self.storage_data[item.storage_index]
        start, end = stored.offset, stored.offset + stored.length
        if mapped is None or file_bytes is None or end > len(mapped):
            raise OSError(f"{stored.relative_path} is shorter than its index says")
        if item.type == LoadItemType.BYTE_IO or stored.transform_descriptors:
            self._read_item_as_torch(item, planner, mapped[start:end])
            return
        try:
            data, stored = _stored_tensor(mapped, file_bytes, start, end)
        except _NotPlain:
            self._read_item_as_torch(item, planner, mapped[start:end])
            return
        target = planner.resolve_tensor(item).detach()
        if stored.is_whole(data) and _takes_bytes(target, stored, item):
            # A byte copy: the stored data need not be aligned for its type.
            target.view(-1).view(torch.uint8).copy_(data)
        else:
            if data.data_ptr() % stored.storage.itemsize:
                data = data.clone()  # aligned for its type
            typed = data.view(stored.storage.dtype)  # as_strided counts from the file's start
            source = typed.as_strided(
                stored.size, stored.stride, typed.storage_offset() + stored.storage_offset
            )
            source = narrow_tensor_by_index(source, item.storage_offsets, item.lengths)
            if target.size() != source.size():
                raise AssertionError(
                    f"req {item.storage_index} mismatch sizes {target.size()} vs {source.size()}"
                )
            target.copy_(source)
        planner.commit_tensor(item, target)

    def _read_item_as_torch(self, item: ReadItem, planner: LoadPlanner, data: bytes) -> None:
        """What torch's ``FileSystemReader.read_data`` does with one item."""
        stored = self.storage_data[item.storage_index]
        stream = self.transforms.transform_load_stream(
            item, stored.transform_descriptors or (), io.BytesIO(data)
        )
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(stream.read(-1)))
            return
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
        tensor = cast(torch.Tensor, torch.load(stream, map_location="cpu", weights_only=True))
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(
                f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _stored_tensor(
    mapped: mmap.mmap, file_bytes: torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, _Rebuilt]:
    """The data bytes (over the mapping) and the description of the tensor that ``torch.save``
    wrote to ``mapped[start:end]``; _NotPlain where the archive is not the plain form this
    reads."""
    records = _zip_records(mapped, start, end)
    if "byteorder" in records and _record(mapped, records["byteorder"]) != b"little":
        raise _NotPlain
    if "data.pkl" not in records:
        raise _NotPlain
    unpickler = _TensorUnpickler(io.BytesIO(_record(mapped, records["data.pkl"])))
    try:
        stored = unpickler.load()
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError):
        raise _NotPlain from None
    if not isinstance(stored, _Rebuilt) or stored.storage.key not in unpickler.storages:
        raise _NotPlain
    offset, nbytes = records.get(f"data/{stored.storage.key}", (0, -1))
    if nbytes != stored.storage.numel * stored.storage.itemsize:
        raise _NotPlain
    return file_bytes[offset : offset + nbytes], stored


def _takes_bytes(target: torch.Tensor, stored: _Rebuilt, item: ReadItem) -> bool:
    """Whether ``item`` is the whole stored tensor and ``target`` a contiguous tensor of its
    type and shape, so that its bytes can be copied as they are."""
    return (
        target.dtype == stored.storage.dtype
        and tuple(target.shape) == stored.size
        and target.is_contiguous()
        and not any(item.storage_offsets)
        and tuple(item.lengths) == stored.size
    )


def _zip_records(mapped: mmap.mmap, start: int, end: int) -> dict[str, tuple[int, int]]:
    """``{name: (file offset, size)}`` of the stored (uncompressed) records of the zip archive
    at ``mapped[start:end]``, names without their archive folder."""
    tail = end - _END_OF_DIRECTORY.size
    if tail < start:
        raise _NotPlain
    signature, _, _, _, count, _, directory, _ = _END_OF_DIRECTORY.unpack_from(mapped, tail)
    if signature != _END_SIGNATURE or directory == 0xFFFFFFFF:
        raise _NotPlain
    records, position = {}, start + directory
    for _ in range(count):
        if position + _DIRECTORY_ENTRY.size > end:
            raise _NotPlain
        entry = _DIRECTORY_ENTRY.unpack_from(mapped, position)
        signature, method, stored_size, size = entry[0], entry[4], entry[8], entry[9]
        name_length, extra_length, comment_length = entry[10:13]
        local = entry[16]
        if signature != _ENTRY_SIGNATURE or method != 0 or stored_size != size:
            raise _NotPlain
        name = mapped[position + 46 : position + 46 + name_length].decode()
        position += 46 + name_length + extra_length + comment_length
        header = _LOCAL_HEADER.unpack_from(mapped, start + local)
        if header[0] != _LOCAL_SIGNATURE:
            raise _NotPlain
        data = start + local + _LOCAL_HEADER.size + header[9] + header[10]
        if data + size > end:
            raise _NotPlain
        records[name.partition("/")[2]] = (data, size)
    return records


def _record(mapped: mmap.mmap, record: tuple[int, int]) -> bytes:
    offset, size = record
    return mapped[offset : offset + size]


class _Storage:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel
        self.itemsize = torch.empty((), dtype=dtype).element_size()


class _Rebuilt:
    def __init__(
        self, storage: _Storage, storage_offset: int, size: Any, stride: Any, *_: Any
    ) -> None:
        if not isinstance(storage, _Storage):
            raise _NotPlain
        self.storage, self.storage_offset = storage, int(storage_offset)
        self.size, self.stride = tuple(map(int, size)), tuple(map(int, stride))

    def is_whole(self, data: torch.Tensor) -> bool:
        """Whether the tensor is its whole storage (``data``), contiguous."""
        contiguous: list[int] = []
        numel = 1
        for length in reversed(self.size):
            contiguous.insert(0, numel)
            numel *= length
        whole = data.numel() == numel * self.storage.itemsize
        return whole and self.storage_offset == 0 and self.stride == tuple(contiguous)


class _TensorUnpickler(pickle.Unpickler):
    """Reads the pickle of one saved tensor into a :class:`_Rebuilt` description; any name but
    those such a pickle refers to raises _NotPlain (nothing else can be built)."""

    def __init__(self, stream: io.BytesIO) -> None:
        super().__init__(stream)
        self.storages: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            try:
                return StorageType(name)  # what torch.load makes of it, without a warning
            except KeyError:
                raise _NotPlain from None
        raise _NotPlain

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotPlain
        _, storage_type, key, _, numel = pid
        if not isinstance(storage_type, StorageType) or not isinstance(numel, int):
            raise _NotPlain
        self.storages.add(str(key))
        return _Storage(str(key), storage_type.dtype, numel)
