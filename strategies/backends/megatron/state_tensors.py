"""Offload for megatron: which tensors make up the model, optimizer state and gradients.

Each part's tensors are views of a few storages (megatron DDP's contiguous buffers, or the
parameters themselves), moved off the device and back by ``strategies.memory.storage_offload``.
"""

from __future__ import annotations

from typing import Any

import torch


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
