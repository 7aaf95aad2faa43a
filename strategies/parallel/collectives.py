"""The few collectives every part uses, safe in a world of one process (no process group)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def collective_timeout() -> float:
    """Seconds a collective of the default process group waits for a peer before failing (what
    ``init_process_group(timeout=...)`` set; torch's default where there is no group)."""
    if dist.is_initialized():
        try:
            store: Any = dist.distributed_c10d._get_default_store()  # its stub lacks timeout
            return float(store.timeout.total_seconds())
        except (AttributeError, RuntimeError, ValueError):  # a store that keeps no timeout
            pass
    return float(dist.default_pg_timeout.total_seconds())


def from_rank_zero(value: T) -> T:
    """Rank 0's ``value`` on every rank."""
    if world_size() == 1:
        return value
    holder: list[Any] = [value]
    dist.broadcast_object_list(holder, src=0)
    result: T = holder[0]
    return result


def merged_dicts(local: dict[str, T]) -> dict[str, T]:
    """Every rank's ``local`` mapping merged into one, on every rank."""
    if world_size() == 1:
        return local
    gathered: list[dict[str, T]] = [{} for _ in range(world_size())]
    dist.all_gather_object(gathered, local)
    return {key: value for part in gathered for key, value in part.items()}


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's tensors must live: the CPU where gloo serves the group; otherwise
    the current accelerator (NCCL and HCCL reduce device tensors only)."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def all_reduce_values(
    values: Sequence[float],
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> list[float]:
    """Element-wise reduction of ``values`` over ``group`` (None: every rank) in one
    all-reduce, on the device the group's backend needs; unchanged in a world of one."""
    if world_size() == 1 or (group is not None and dist.get_world_size(group) == 1):
        return [float(value) for value in values]
    where = torch.device(device) if device is not None else collective_device(group)
    tensor = torch.tensor(list(values), dtype=dtype, device=where)
    dist.all_reduce(tensor, op=op, group=group)
    return [float(value) for value in tensor.tolist()]
