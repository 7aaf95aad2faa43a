"""Ulysses sequence parallelism for the fsdp2 backend: each sequence split over a group of
``ulysses_size`` ranks, which exchange heads for sequence around attention.

Layout: ranks ``k * U .. k * U + U - 1`` form a sequence-parallel group and take the same
micro-batches (one data-parallel rank); each holds a contiguous ``1 / U`` of every row (rows are
padded at the end to a multiple of ``U``; a packed row's padding is one more segment). Every
layer but attention runs on the rank's own tokens. Attention gets its queries, keys and values
through an all-to-all: sequence parts of all heads in, all of the sequence of ``1 / U`` of the
heads out; it attends exactly (causal, per sequence when packed) and exchanges back. Key/value
heads fewer than ``U`` are repeated so each rank gets one (``U`` a multiple of them).

The output layer and the head run on the rank's own tokens too (``heads.base.SequenceSplit``):
only the head's per-token results (one number per token and result) are gathered into the
caller's layout, so a rank's logits never exceed its own tokens (a head that cannot run position
by position gets the raw output gathered instead). Every rank of the group computes the same
loss from the gathered results; the loss that goes backward is divided by ``U`` and the
gather's backward sums the ranks' gradients, so each rank's share is its own tokens' gradient
once, and FSDP's sum over all ranks gives the output layer's gradient once. FSDP shards over
every rank, as without Ulysses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from strategies.model.packed_attention import Window, attend_per_sequence
from strategies.parallel.sequence_split import all_to_all

#: (world size, Ulysses size) -> (this rank's sequence-parallel group, its data-parallel group).
_GROUPS: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def sequence_groups(size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's sequence-parallel group (``size`` consecutive ranks) and data-parallel group
    (the ranks at its place in every other group); collective on first use."""
    world, rank = dist.get_world_size(), dist.get_rank()
    key = (world, size)
    if key not in _GROUPS:
        mine: dict[str, dist.ProcessGroup] = {}
        for start in range(0, world, size):  # every rank creates every group, in one order
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine["sequence"] = group
        for offset in range(size):
            group = dist.new_group(list(range(offset, world, size)))
            if rank % size == offset:
                mine["data"] = group
        _GROUPS[key] = (mine["sequence"], mine["data"])
    return _GROUPS[key]


def attend_across_ranks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    bounds: Sequence[int] | None,
    *,
    scale: float | None,
    window: Window | None,
    dropout: float,
) -> torch.Tensor:
    """``query`` ``[b, heads, s / U, dim]`` and ``key`` / ``value`` ``[b, groups, s / U, dim]``
    of this rank -> its attention output ``[b, heads, s / U, dim]``, attending over the whole
    row (causal inside each segment of ``bounds``, the whole row where None)."""
    size = dist.get_world_size(group)
    groups = key.shape[1]
    if groups % size:  # fewer key/value heads than ranks: one copy for each rank's heads
        key, value = (x.repeat_interleave(size // groups, dim=1) for x in (key, value))
    query, key, value = (all_to_all(x, group, scatter=1, gather=2) for x in (query, key, value))
    width = query.shape[2]
    out = attend_per_sequence(
        query,
        key,
        value,
        (0, width) if bounds is None else bounds,
        scale=scale,
        window=window,
        dropout=dropout,
    )
    return all_to_all(out, group, scatter=2, gather=1)


def check_heads(heads: int, groups: int, size: int) -> str | None:
    """Why ``heads`` query and ``groups`` key/value heads cannot be split over ``size`` ranks
    (None if they can)."""
    if heads % size:
        return f"num_attention_heads ({heads}) must be divisible by ulysses_size ({size})"
    if groups % size and size % groups:
        return (
            f"num_query_groups ({groups}) must be a multiple or a divisor of ulysses_size ({size})"
        )
    return None
