"""One micro-batch's rows as the model runs them, built once per micro-batch and passed down:
the row width, the segments attention stays inside, where a packed row's real tokens sit, the
positions inside sequences, and how context parallelism cuts every segment over its ranks.

Both backends build their micro-batches' layouts with :func:`row_layouts` at the start of a
step; the forward, the attention and the loss read them instead of working them out again.

Context parallelism (megatron's load-balanced layout, the one its rotary embedding assumes):
each segment (the whole row when right-padded; each sequence, and the row's padding, when
packed, every sequence padded to a multiple of ``2 x CP``) is cut into ``2 x CP`` chunks, and
rank ``r`` holds chunks ``r`` and ``2 x CP - 1 - r`` of every segment
(:meth:`RowLayout.chunk_bounds`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import torch

from heads.base import SequenceSplit
from strategies.model.packed_attention import positions_in_sequences, row_segments
from strategies.parallel.sequence_split import gather_sequence


class MicroBatchRows(Protocol):
    """What a layout reads of a micro-batch (structural: the backends' ``MicroBatch`` fits):
    ``input_ids`` ``[b, s]`` right-padded, or ``[1, T]`` packed with each sequence's offset in
    ``cu_seqlens`` (``[b + 1]``, host)."""

    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def cu_seqlens(self) -> torch.Tensor | None: ...


def padded_offsets(cu_seqlens: Sequence[int], size: int) -> tuple[int, ...]:
    """Sequence offsets of a packed row with every sequence padded to a multiple of
    ``2 * size`` tokens (its real tokens first)."""
    multiple = 2 * size
    bounds = [0]
    for start, end in itertools.pairwise(cu_seqlens):
        bounds.append(bounds[-1] + -(-(end - start) // multiple) * multiple)
    return tuple(bounds)


@attrs.frozen(kw_only=True)
class RowLayout:
    """How one micro-batch's rows are laid out for the model (host numbers only)."""

    #: Rows the model runs: the micro-batch's sequences right-padded, or one packed row.
    rows: int
    #: The micro-batch's own row length (``input_ids.shape[1]``).
    length: int
    #: The row length the model runs: ``length`` or more (padding at the end of every row).
    width: int
    #: Packed: each sequence's offset in the row (``[b + 1]``), every sequence padded to a
    #: multiple of ``2 x CP`` under context parallelism; None: right-padded rows.
    sequences: tuple[int, ...] | None = None
    #: Packed: each sequence's real tokens.
    real_lengths: tuple[int, ...] = ()
    #: The context-parallel ranks every segment is split over (``2 x CP`` chunks each).
    context_parallel_size: int = 1

    def __attrs_post_init__(self) -> None:
        if self.sequences is not None and self.sequences[-1] > self.width:
            raise ValueError(f"sequences end at {self.sequences[-1]}, past the row ({self.width})")
        chunks = 2 * self.context_parallel_size
        if self.context_parallel_size > 1 and any(
            (end - start) % chunks for start, end in itertools.pairwise(self.bounds)
        ):
            raise ValueError(
                f"the segments {self.bounds} of a row cannot each be cut into {chunks} chunks"
            )

    @property
    def packed(self) -> bool:
        return self.sequences is not None

    @functools.cached_property
    def bounds(self) -> tuple[int, ...]:
        """The segments attention stays inside: the whole row when right-padded; each sequence
        when packed, the row's padding past the last one a segment of its own."""
        if self.sequences is None:
            return (0, self.width)
        return row_segments(self.sequences, self.width)

    @property
    def longest(self) -> int:
        """The longest segment."""
        return max(end - start for start, end in itertools.pairwise(self.bounds))

    @functools.cached_property
    def real_positions(self) -> torch.Tensor | None:
        """Where a packed row's real tokens go in the model's row (int64, host) when its
        sequences are padded (context parallelism); None where they stay back to back from 0."""
        if self.sequences is None or self.context_parallel_size == 1:
            return None
        lengths = torch.tensor(self.real_lengths)
        starts = torch.tensor(self.sequences[:-1]) - (lengths.cumsum(0) - lengths)
        return torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts, lengths)

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Each token's position inside its own segment, ``[width]`` int64, host."""
        return positions_in_sequences(torch.tensor(self.bounds, dtype=torch.int32))

    def positions_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`positions` ``[1, width]`` on ``device`` (right-padded rows: drawn there)."""
        if self.sequences is None:
            return torch.arange(self.width, device=device)[None]
        return self.positions.to(device, non_blocking=True)[None]

    def chunk_bounds(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The ``(start, end)`` row ranges context-parallel rank ``rank`` holds, in its order:
        chunks ``rank`` and ``2 x CP - 1 - rank`` of every segment."""
        size = self.context_parallel_size
        ranges = []
        for start, end in itertools.pairwise(self.bounds):
            chunk = (end - start) // (2 * size)
            for index in (rank, 2 * size - 1 - rank):
                ranges.append((start + index * chunk, start + (index + 1) * chunk))
        return tuple(ranges)

    def to_caller(self, values: torch.Tensor) -> torch.Tensor:
        """Values of the model's rows ``[rows, width, *features]`` in the micro-batch's own
        layout ``[rows, length, *features]`` (the padding left out)."""
        real = self.real_positions
        if real is None:
            return values[:, : self.length]
        return values.index_select(1, real.to(values.device, non_blocking=True))

    @functools.cached_property
    def caller_positions(self) -> torch.Tensor:
        """For each position of the model's row ``[width]``, the micro-batch position it
        stands for (0 for the padding), host."""
        caller = torch.zeros(self.width, dtype=torch.long)
        real = self.real_positions
        places = torch.arange(self.length)
        if real is None:
            caller[: self.length] = places
        else:
            caller[real] = places
        return caller

    def split(
        self, held: torch.Tensor, group: Any, order: torch.Tensor | None = None
    ) -> SequenceSplit:
        """What a head is told of a raw output holding the row positions ``held`` (this rank's,
        in its order) of ``group``'s split of the rows: where they stand in the micro-batch,
        and the gather of per-position values into its layout (``order``: the row positions
        of the ranks' parts one after another, None where that is the row's order)."""
        positions = self.caller_positions.to(held.device, non_blocking=True).index_select(0, held)
        return SequenceSplit(
            positions=positions,
            gather=functools.partial(self._gather, group=group, order=order),
        )

    def _gather(
        self, part: torch.Tensor, *, group: Any, order: torch.Tensor | None
    ) -> torch.Tensor:
        return self.to_caller(gather_sequence(part, group, 1, order))

    def held_by(self, rank: int, device: torch.device) -> torch.Tensor:
        """The row positions context-parallel rank ``rank`` holds, in its order."""
        return torch.cat(
            [torch.arange(start, end, device=device) for start, end in self.chunk_bounds(rank)]
        )


def row_layouts(
    micro_batches: Sequence[MicroBatchRows],
    *,
    context_parallel_size: int = 1,
    multiple: int = 1,
    same_width: bool = False,
) -> list[RowLayout]:
    """Each micro-batch's layout, once per step. A row runs its own length (packed under
    context parallelism: its sequences each padded to ``2 x CP`` tokens), or the longest of the
    step where every row must have one shape (``same_width``), rounded up to a multiple of
    ``multiple`` (of ``2 x CP`` under context parallelism)."""
    rows = [_sequences(mb, context_parallel_size) for mb in micro_batches]
    widths = [
        length if sequences is None or context_parallel_size == 1 else sequences[-1]
        for _, length, sequences, _ in rows
    ]
    if same_width:
        widths = [max(widths)] * len(widths)
    return [
        RowLayout(
            rows=count,
            length=length,
            width=-(-width // multiple) * multiple,
            sequences=sequences,
            real_lengths=real_lengths,
            context_parallel_size=context_parallel_size,
        )
        for (count, length, sequences, real_lengths), width in zip(rows, widths, strict=True)
    ]


def _sequences(
    micro_batch: MicroBatchRows, context_parallel_size: int
) -> tuple[int, int, tuple[int, ...] | None, tuple[int, ...]]:
    """``micro_batch``'s rows and row length, and packed: its sequences' offsets in the model's
    row (padded to ``2 x CP`` tokens each under context parallelism) and real lengths."""
    rows, length = micro_batch.input_ids.shape
    if micro_batch.cu_seqlens is None:
        return rows, length, None, ()
    offsets = tuple(int(offset) for offset in micro_batch.cu_seqlens.tolist())
    lengths = tuple(end - start for start, end in itertools.pairwise(offsets))
    if context_parallel_size > 1:
        offsets = padded_offsets(offsets, context_parallel_size)
    return rows, length, offsets, lengths
