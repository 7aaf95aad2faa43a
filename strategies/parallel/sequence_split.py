"""Collectives for splitting sequences over ranks, with their gradients: what context
parallelism (megatron) and Ulysses sequence parallelism (fsdp2) exchange.

* :func:`gather_sequence`: every rank's part of the rows joined along the sequence; backward,
  each rank's part gets the sum of every rank's gradient (reduce-scatter), so activations that
  every rank reads (keys and values, the output of the last layer) send each rank's share back.
* :func:`all_to_all`: a tensor split along one dimension and the pieces exchanged, joined along
  another (Ulysses: sequence parts of all heads <-> all the sequence of some heads); backward,
  the reverse exchange.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from strategies.parallel.collectives import collective_device


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (in rank order, then placed by ``order`` where given); backward:
    reduce-scatter."""

    @staticmethod
    def forward(
        ctx: Any, part: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor | None
    ) -> torch.Tensor:
        size = dist.get_world_size(group)
        wire = collective_device(group)
        shape = (part.shape[0] * size, *part.shape[1:])
        gathered = torch.empty(shape, dtype=part.dtype, device=wire)
        dist.all_gather_into_tensor(gathered, part.contiguous().to(wire), group=group)
        gathered = gathered.to(part.device)
        ctx.group, ctx.order = group, order
        if order is None:
            return gathered
        whole = torch.empty_like(gathered)
        whole[order] = gathered
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        size = dist.get_world_size(ctx.group)
        wire = collective_device(ctx.group)
        by_rank = grad if ctx.order is None else grad[ctx.order]
        part = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype, device=wire)
        dist.reduce_scatter_tensor(part, by_rank.contiguous().to(wire), group=ctx.group)
        return part.to(grad.device), None, None


def gather_sequence(
    part: torch.Tensor, group: dist.ProcessGroup, dim: int, order: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's part of the rows (along ``dim``) joined with the other ranks' parts: in rank
    order, or at the positions ``order`` gives the rank-ordered concatenation. The gradient of
    each rank's part sums every rank's gradient."""
    whole: torch.Tensor = _GatherSequence.apply(part.movedim(dim, 0), group, order)
    return whole.movedim(0, dim)


class _AllToAll(torch.autograd.Function):
    """Split ``dim`` ``scatter`` into the group's size, send piece ``j`` to rank ``j``, join the
    received pieces along ``gather`` in rank order; backward: the reverse."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int
    ) -> torch.Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    wire = collective_device(group)
    pieces = torch.stack(x.chunk(size, dim=scatter)).contiguous().to(wire)
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group)
    return torch.cat(received.to(x.device).unbind(0), dim=gather)


def all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int
) -> torch.Tensor:
    """``x`` split along ``scatter`` over the group's ranks, and what they send joined along
    ``gather`` (in rank order); the gradient goes back the same way."""
    exchanged: torch.Tensor = _AllToAll.apply(x, group, scatter, gather)
    return exchanged
