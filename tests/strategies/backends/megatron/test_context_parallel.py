"""Context parallelism's layout: megatron's load-balanced chunks and the padded packed rows
(the layouts trained across processes are compared to one process in
tests/engine/test_parallel.py)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from strategies.backends.megatron.backend import _padded_sequences
from strategies.backends.megatron.context_parallel import local_positions, padded_bounds


@given(size=st.integers(1, 4), chunk=st.integers(1, 5))
def test_every_position_is_held_by_one_rank_and_each_holds_chunks_r_and_2cp_minus_1_minus_r(
    size: int, chunk: int
) -> None:
    """Each rank holds the same number of tokens; their union is the row, once each; rank r
    holds chunks r and 2 x CP - 1 - r (megatron's rotary embedding assumes that order)."""
    width = 2 * size * chunk
    parts = [local_positions(width, rank, size, torch.device("cpu")) for rank in range(size)]
    assert all(len(part) == width // size for part in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(width))
    for rank, part in enumerate(parts):
        chunks = part.div(chunk, rounding_mode="floor").unique().tolist()
        assert chunks == sorted({rank, 2 * size - 1 - rank})


@given(lengths=st.lists(st.integers(1, 13), min_size=1, max_size=5), size=st.integers(1, 4))
def test_a_packed_row_pads_each_sequence_to_2cp_chunks_keeping_its_tokens_first(
    lengths: list[int], size: int
) -> None:
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    bounds, real = _padded_sequences(cu_seqlens, size)
    assert bounds.tolist() == padded_bounds(cu_seqlens.tolist(), size)
    for start, end, length in zip(bounds[:-1], bounds[1:], lengths, strict=True):
        assert (end - start) % (2 * size) == 0 and 0 <= end - start - length < 2 * size
    expected = [
        int(start) + i for start, n in zip(bounds[:-1], lengths, strict=True) for i in range(n)
    ]
    assert real.tolist() == expected
