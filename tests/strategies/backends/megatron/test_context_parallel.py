"""Context parallelism's layout: megatron's load-balanced chunks and the padded packed rows
(the layouts trained across processes are compared to one process in
tests/engine/test_parallel.py)."""

from __future__ import annotations

import attrs
import torch
from hypothesis import given
from hypothesis import strategies as st

from strategies.backends.megatron.context_parallel import Layout
from strategies.model.row_layout import RowLayout, padded_offsets, row_layouts


class Packed:
    """A packed micro-batch of ``lengths`` (what a row layout reads of it)."""

    def __init__(self, lengths: list[int]) -> None:
        self.cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        self.input_ids = torch.zeros(1, int(self.cu_seqlens[-1]), dtype=torch.long)


@given(size=st.integers(1, 4), chunk=st.integers(1, 5))
def test_every_position_is_held_by_one_rank_and_each_holds_chunks_r_and_2cp_minus_1_minus_r(
    size: int, chunk: int
) -> None:
    """Each rank holds the same number of tokens; their union is the row, once each; rank r
    holds chunks r and 2 x CP - 1 - r (megatron's rotary embedding assumes that order)."""
    width = 2 * size * chunk
    row = RowLayout(rows=1, length=width, width=width, context_parallel_size=size)
    parts = [row.held_by(rank, torch.device("cpu")) for rank in range(size)]
    assert all(len(part) == width // size for part in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(width))
    for rank, part in enumerate(parts):
        chunks = part.div(chunk, rounding_mode="floor").unique().tolist()
        assert chunks == sorted({rank, 2 * size - 1 - rank})


@given(lengths=st.lists(st.integers(1, 13), min_size=1, max_size=5), size=st.integers(2, 4))
def test_a_packed_row_pads_each_sequence_to_2cp_chunks_keeping_its_tokens_first(
    lengths: list[int], size: int
) -> None:
    (row,) = row_layouts([Packed(lengths)], context_parallel_size=size)
    bounds, real = row.sequences, row.real_positions
    assert bounds is not None and real is not None and row.width == bounds[-1]
    assert bounds == padded_offsets(Packed(lengths).cu_seqlens.tolist(), size)
    for start, end, length in zip(bounds[:-1], bounds[1:], lengths, strict=True):
        assert (end - start) % (2 * size) == 0 and 0 <= end - start - length < 2 * size
    expected = [
        int(start) + i for start, n in zip(bounds[:-1], lengths, strict=True) for i in range(n)
    ]
    assert real.tolist() == expected


@given(
    lengths=st.lists(st.integers(1, 13), min_size=1, max_size=5),
    size=st.integers(2, 4),
    packed=st.booleans(),
    spare=st.integers(0, 2),
)
def test_splitting_a_row_over_the_ranks_and_gathering_it_back_gives_the_row(
    lengths: list[int], size: int, packed: bool, spare: int
) -> None:
    """Split (each rank's positions) then gather (the parts in rank order, placed by ``order``)
    returns every token where it was, packed (sequences padded in the row) or padded; in the
    gathered row and in each block of the ring, each rank's queries see exactly the keys at or
    before them in their own sequence."""
    cpu = torch.device("cpu")
    total = sum(lengths)
    multiple = 2 * size
    if packed:
        natural = row_layouts([Packed(lengths)], context_parallel_size=size)[0]
        rows = attrs.evolve(natural, width=natural.width + spare * multiple)
        real = rows.real_positions
        assert real is not None
    else:
        width = -(-total // multiple) * multiple + spare * multiple
        rows = RowLayout(rows=1, length=total, width=width, context_parallel_size=size)
        real = torch.arange(total)
    width, bounds = rows.width, rows.bounds
    assert bounds == ((*rows.sequences, width) if packed and spare else rows.sequences or bounds)
    tokens = torch.arange(total) + 100
    row = torch.zeros(width, dtype=torch.long).index_copy_(0, real, tokens)
    layouts = [Layout(rows, rank, cpu) for rank in range(size)]
    parts = [layout.split(row, 0) for layout in layouts]
    assert all(len(part) == width // size for part in parts)
    gathered = torch.empty_like(row)
    gathered[layouts[0].order] = torch.cat(parts)
    assert torch.equal(gathered, row)
    assert torch.equal(gathered[real], tokens)
    segment_of = [
        next(i for i in range(len(bounds) - 1) if bounds[i] <= p < bounds[i + 1])
        for p in range(width)
    ]
    for layout in layouts:
        visible = layout.visible_keys(None)  # the gathered row's keys
        for query, seen in zip(layout.local.tolist(), visible, strict=True):
            expected = [k <= query and segment_of[k] == segment_of[query] for k in range(width)]
            assert seen.tolist() == expected
        ring = layout.ring()  # the ring's blocks: each rank's keys in turn
        for source in range(size):
            keys = ring.positions[source].tolist()
            visible = ring.visible(source, None)
            for query, seen in zip(layout.local.tolist(), visible, strict=True):
                expected = [k <= query and segment_of[k] == segment_of[query] for k in keys]
                assert seen.tolist() == expected


def test_ring_attention_refuses_attention_dropout_by_name() -> None:
    """The ring attends block by block; a dropout mask would have to be drawn as one call over
    the whole row draws it, so it is refused (the all-gathered attention keeps it)."""
    from types import SimpleNamespace

    import pytest

    from heads.errors import ConfigError
    from strategies.backends.megatron.attention import SoftmaxSettings, check_context_parallel
    from strategies.backends.megatron.context_parallel import ContextAttention

    cpu = torch.device("cpu")
    layout = Layout(RowLayout(rows=1, length=8, width=8, context_parallel_size=2), 0, cpu)
    dropout = SoftmaxSettings(scale=1.0, dropout=0.1, window=None, random=None)
    gathered = SimpleNamespace(context=ContextAttention(layout))
    check_context_parallel(True, False, gathered, dropout)
    ring = SimpleNamespace(context=ContextAttention(layout, layout.ring()))
    with pytest.raises(ConfigError, match=r"ring attention .* has no attention dropout"):
        check_context_parallel(True, False, ring, dropout)
