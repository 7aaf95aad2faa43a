"""The few collectives every part uses, safe in a world of one process (no process group)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


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
