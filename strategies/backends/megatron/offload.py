"""Offload: move the model, optimizer state or gradients off the device and back.

Each part's tensors are views of a few storages (megatron DDP's contiguous buffers, or the
parameters themselves). Offloading copies each storage to host memory and resizes the
device storage to zero bytes; every view (parameters, ``main_grad``, buffers) stays valid and
sees the data again once the storage is restored in place. Works the same for any device,
so on CPU the parameters' storage really is emptied and moved to the host copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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


def model_tensors(chunks: list[torch.nn.Module], wrapped: list[Any]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = [param for chunk in chunks for param in chunk.parameters()]
    for buffer in _ddp_buffers(wrapped):
        if buffer.param_data is not None:
            tensors.append(buffer.param_data)
    return tensors


def grad_tensors(wrapped: list[Any]) -> list[torch.Tensor]:
    return [buffer.grad_data for buffer in _ddp_buffers(wrapped) if buffer.grad_data is not None]


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Adam moments and any optimizer-owned parameter copies (e.g. fp32 master weights)."""
    tensors: list[torch.Tensor] = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        for group in torch_optimizer.param_groups:
            tensors.extend(p for p in group["params"] if isinstance(p, torch.Tensor))
        for state in torch_optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    return tensors


def _ddp_buffers(wrapped: list[Any]) -> list[Any]:
    """Megatron DDP's parameter/gradient buffers (a forward-only model is not DDP-wrapped, and
    its ``buffers`` is ``nn.Module.buffers``, a method)."""
    found = []
    for module in wrapped:
        for name in ("buffers", "expert_parallel_buffers"):
            buffers = getattr(module, name, [])
            found += buffers if isinstance(buffers, list) else []
    return found
