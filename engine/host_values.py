"""Bringing a step's numbers to the host in one transfer.

On an accelerator, every ``float(tensor)`` / ``.item()`` / ``bool(tensor)`` blocks the host until
the device has run everything queued before it, so a step that converts each micro-batch's loss
and metrics as it goes waits on the device once per number and cannot queue the next
micro-batch's kernels meanwhile. The engine keeps those numbers as device tensors while the step
runs and fetches them all here, once, at its end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: A number a step produces: already on the host, or a one-element tensor still on its device.
Number = float | torch.Tensor


def fetch(values: Sequence[Number]) -> list[float]:
    """``values`` as Python floats, with one device-to-host transfer per device that holds any
    of them (one in practice: the engine's); host floats pass through."""
    result: list[float] = [0.0] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(index)
        else:
            result[index] = float(value)
    for indices in by_device.values():
        stacked = torch.stack(
            [values[i].detach().reshape(()).to(torch.float64) for i in indices]  # type: ignore[union-attr]
        )
        for index, number in zip(indices, stacked.tolist(), strict=True):
            result[index] = float(number)
    return result
