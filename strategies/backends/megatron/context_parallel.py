"""Context parallelism on megatron's local layer spec: each sequence split over the
context-parallel ranks in megatron's load-balanced layout, attention exact across the parts.

Layout (megatron's, the one its rotary embedding assumes): each segment of a row (the whole row
when padded; each sequence, and the row's padding, when packed, every sequence padded to a
multiple of ``2 x CP``) is cut into ``2 x CP`` chunks; rank ``r`` holds chunks ``r`` and
``2 x CP - 1 - r`` of every segment, so every rank gets as much of the causal attention's work
as any other. The model runs on each rank's ``width / CP`` tokens.

Attention: every rank all-gathers the keys and values of the whole row (their gradient is
reduce-scattered back) and attends with its own queries under the causal mask of their global
positions inside their own segment (the document mask), as Llama 3's long-context training
did. The activations outside attention, and the
attention's queries and outputs, stay split; only K and V (``2 x groups x head_dim`` per token,
a fraction of the hidden size with grouped-query attention) are held whole.

Outputs: the last stage gathers its output (the hidden states a fused head reads, logits, or
values) back into the caller's layout, so the head and the loss see whole sequences. Every
context-parallel rank then computes the same loss; the loss that goes backward is divided by CP
and the gather's backward sums the ranks' gradients (reduce-scatter), so each rank's share is
its own tokens' gradient once, and the output layer's gradient, computed on every rank, adds up
to one over the data x context parallel gradient reduction.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from strategies.parallel.sequence_split import gather_sequence


def local_positions(width: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    """The positions of a ``width``-token segment that context-parallel rank ``rank`` of ``size``
    holds, in its order: chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size``."""
    chunk = width // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, second])


def padded_bounds(cu_seqlens: Sequence[int], size: int) -> list[int]:
    """Sequence offsets of a packed row with every sequence padded to a multiple of
    ``2 * size`` tokens (its real tokens first)."""
    multiple = 2 * size
    bounds = [0]
    for start, end in itertools.pairwise(cu_seqlens):
        bounds.append(bounds[-1] + -(-(end - start) // multiple) * multiple)
    return bounds


@attrs.frozen
class Layout:
    """How one micro-batch's rows of ``bounds[-1]`` tokens, in segments ``bounds``, are split
    over ``size`` context-parallel ranks (this one ``rank`` of ``group``)."""

    bounds: tuple[int, ...]
    size: int
    rank: int
    device: torch.device
    group: Any = None

    @classmethod
    def over(cls, bounds: tuple[int, ...], group: Any, device: torch.device) -> Layout:
        """The layout of ``bounds`` over the context-parallel ``group``, for this rank."""
        return cls(bounds, dist.get_world_size(group), dist.get_rank(group), device, group)

    def held_by(self, rank: int) -> torch.Tensor:
        """The row positions rank ``rank`` holds, in its order."""
        return torch.cat(
            [
                start + local_positions(end - start, rank, self.size, self.device)
                for start, end in itertools.pairwise(self.bounds)
            ]
        )

    @functools.cached_property
    def local(self) -> torch.Tensor:
        """This rank's positions."""
        return self.held_by(self.rank)

    @functools.cached_property
    def order(self) -> torch.Tensor:
        """The positions of the ranks' parts one after another (what an all-gather joins)."""
        return torch.cat([self.held_by(rank) for rank in range(self.size)])

    def split(self, whole: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of ``whole`` along ``dim`` (no gradient exchange)."""
        return whole.index_select(dim, self.local)

    def gather(self, part: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part (along ``dim``) joined with the other ranks' into the row's order;
        the gradient of each rank's part sums every rank's gradient."""
        return gather_sequence(part, self.group, dim, self.order)

    def visible_keys(self, window: tuple[int, int] | None) -> torch.Tensor:
        """``[local queries, row]`` True where this rank's query attends a key: causal in their
        row positions, inside the query's segment, within megatron's sliding ``window``
        (left, right) where given."""
        width = self.bounds[-1]
        keys = torch.arange(width, device=self.device)
        bounds = torch.tensor(self.bounds[1:-1], device=self.device)
        segment = torch.bucketize(keys, bounds, right=True)
        queries = self.local
        relative = keys[None, :] - queries[:, None]  # key - query
        visible = (relative <= 0) & (segment[None, :] == segment[queries][:, None])
        if window is not None:
            visible &= relative >= -window[0]
        return visible
