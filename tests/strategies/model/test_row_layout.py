"""A micro-batch's row layout against values worked out by hand: uneven sequence lengths,
right-padded and packed, split over two context-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from strategies.model.row_layout import RowLayout, row_layouts

CPU = torch.device("cpu")


class MicroBatch:
    """A micro-batch as a layout reads it: right-padded ``[rows, length]``, or packed."""

    def __init__(self, rows: int, length: int, lengths: list[int] | None = None) -> None:
        self.input_ids = torch.zeros(rows, length, dtype=torch.long)
        self.cu_seqlens = None
        if lengths is not None:
            self.cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def test_packed_rows_over_two_context_parallel_ranks_pad_each_sequence_to_four_tokens() -> None:
    """Sequences of 3, 5, 1 tokens -> 4, 8, 4 (multiples of 2 x CP); a second micro-batch of
    one 2-token sequence runs as long (one shape for the schedule), its padding one segment."""
    first, second = row_layouts(
        [MicroBatch(1, 9, [3, 5, 1]), MicroBatch(1, 2, [2])],
        context_parallel_size=2,
        multiple=4,
        same_width=True,
    )
    assert (first.rows, first.length, first.width) == (1, 9, 16)
    assert first.sequences == (0, 4, 12, 16) and first.real_lengths == (3, 5, 1)
    assert first.bounds == (0, 4, 12, 16) and first.longest == 8
    assert first.real_positions is not None
    assert first.real_positions.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 12]
    assert first.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    # rank r holds chunks r and 3 - r of every segment (each cut into 4 chunks)
    assert first.chunk_bounds(0) == ((0, 1), (3, 4), (4, 6), (10, 12), (12, 13), (15, 16))
    assert first.chunk_bounds(1) == ((1, 2), (2, 3), (6, 8), (8, 10), (13, 14), (14, 15))
    assert first.held_by(1, CPU).tolist() == [1, 2, 6, 7, 8, 9, 13, 14]

    assert (second.length, second.width, second.sequences) == (2, 16, (0, 4))
    assert second.bounds == (0, 4, 16) and second.longest == 12
    assert second.real_positions is not None and second.real_positions.tolist() == [0, 1]
    assert second.positions.tolist() == [0, 1, 2, 3, *range(12)]
    assert second.chunk_bounds(0) == ((0, 1), (3, 4), (4, 7), (13, 16))


def test_right_padded_rows_are_one_segment_rounded_up_to_the_multiple() -> None:
    (padded,) = row_layouts([MicroBatch(3, 5)], context_parallel_size=2, multiple=4)
    assert (padded.rows, padded.length, padded.width) == (3, 5, 8)
    assert padded.sequences is None and not padded.packed and padded.real_positions is None
    assert padded.bounds == (0, 8)
    assert padded.positions_on(CPU).tolist() == [list(range(8))]
    assert padded.chunk_bounds(0) == ((0, 2), (6, 8))
    assert padded.chunk_bounds(1) == ((2, 4), (4, 6))


def test_without_context_parallelism_packed_tokens_stay_back_to_back() -> None:
    """Each micro-batch its own width (Ulysses' multiple of 2 here); the row's padding past the
    last sequence is one more segment."""
    packed, padded = row_layouts([MicroBatch(1, 7, [4, 3]), MicroBatch(2, 3)], multiple=2)
    assert (packed.width, packed.sequences, packed.bounds) == (8, (0, 4, 7), (0, 4, 7, 8))
    assert packed.real_positions is None and packed.real_lengths == (4, 3)
    assert packed.positions_on(CPU).tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert (padded.rows, padded.width, padded.bounds) == (2, 4, (0, 4))


def test_a_row_that_context_parallelism_cannot_cut_evenly_is_refused() -> None:
    with pytest.raises(ValueError, match="cut into 4 chunks"):
        RowLayout(rows=1, length=6, width=6, context_parallel_size=2)
    with pytest.raises(ValueError, match=r"\(0, 4, 6, 8\)"):  # 2 tokens between 4 and 6
        RowLayout(
            rows=1, length=6, width=8, sequences=(0, 4, 6), real_lengths=(3, 2),
            context_parallel_size=2,
        )  # fmt: skip
