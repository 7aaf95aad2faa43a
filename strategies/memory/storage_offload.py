"""Offload by storage: copy the storages behind some tensors to host memory and empty them on
the device, then restore them in place.

Every view of a stashed storage (parameters, gradient buffers, optimizer moments) stays valid
and sees the data again once the storage is restored, so a backend offloads a part of its state
without rebuilding anything. Works the same for any device; on CPU the storage really is
emptied and its bytes kept in the host copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import attrs
import torch


@attrs.define
class StorageStash:
    """Storages emptied on their device, with their bytes kept on the host."""

    entries: list[tuple[torch.UntypedStorage, torch.Tensor]] = attrs.field(factory=list)

    def restore(self) -> None:
        for storage, host in self.entries:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host)
        self.entries.clear()


def stash(tensors: Iterable[torch.Tensor], keep: set[int] | None = None) -> StorageStash:
    """Copy the storages behind ``tensors`` to the host and empty them (``keep``: data
    pointers of storages to leave alone, e.g. model weights the optimizer also holds)."""
    result, seen = StorageStash(), set(keep or ())
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu")
        host.copy_(_bytes_of(storage))
        storage.resize_(0)
        result.entries.append((storage, host))
    return result


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@attrs.define
class OffloadedParts:
    """The parts of a backend's state (``model``, ``optimizer``, ``grad``) in host memory."""

    stashes: dict[str, StorageStash] = attrs.field(factory=dict)

    def offload(
        self, parts: Iterable[str], tensors: Mapping[str, Callable[[], list[torch.Tensor]]]
    ) -> None:
        """Stash each of ``parts`` not stashed yet, from ``tensors[part]()``; a part without an
        entry (the optimizer of a forward-only engine) is skipped. The optimizer's stash leaves
        the model's storages alone (a plain optimizer steps the model's own tensors)."""
        for part in parts:
            if part in self.stashes or part not in tensors:
                continue
            keep = None
            if part == "optimizer" and "model" in tensors:
                keep = {tensor.untyped_storage().data_ptr() for tensor in tensors["model"]()}
            self.stashes[part] = stash(tensors[part](), keep=keep)

    def reload(self, parts: Iterable[str]) -> None:
        """Restore the stashed ``parts`` in place."""
        for part in parts:
            stashed = self.stashes.pop(part, None)
            if stashed is not None:
                stashed.restore()

    def names(self) -> frozenset[str]:
        return frozenset(self.stashes)
