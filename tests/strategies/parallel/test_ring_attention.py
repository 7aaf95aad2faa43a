"""Ring attention equals attention over the whole row (``softmax(q k^T * scale + mask) v``,
causal inside each segment, within a sliding window where given), forward and gradient, for
drawn rows (right-padded or packed segments), splits (megatron's load-balanced chunks, or
contiguous parts), key/value groups, query tiles and ring sizes; every rank holds only its
positions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess

HEADS, DIM = 4, 8


@st.composite
def cases(draw: Any, size: int) -> dict[str, Any]:
    """A row of segments (their lengths), a split, key/value groups, a window and a seed."""
    chunks = 2 * size  # megatron's split cuts every segment into 2 x size chunks
    segments = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    return {
        "segments": [chunks * n for n in segments],
        "split": draw(st.sampled_from(["balanced", "contiguous"])),
        "groups": draw(st.sampled_from([1, 2, 4])),
        "window": draw(st.sampled_from([None, (3, 0), (9, 0)])),
        "rows": draw(st.integers(1, 2)),
        "seed": draw(st.integers(0, 2**16)),
        # scores a query tile may hold: one tile per block, or a few queries per tile
        "tile": draw(st.sampled_from([1 << 22, 64, 1])),
    }


def attend_on_every_rank(cases: list[dict[str, Any]]) -> list[dict[str, float]]:
    """For each case: this rank's ring attention output and gradients against the whole row's
    attention at its positions (the largest differences)."""
    import torch.distributed as dist

    from strategies.model.row_layout import RowLayout
    from strategies.parallel import ring_attention as ring
    from strategies.parallel.ring_attention import RingLayout, ring_attention

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    report = []
    for case in cases:
        ring.TILE_ELEMENTS = case["tile"]
        segments = case["segments"]
        width = sum(segments)
        bounds = torch.tensor([0, *segments]).cumsum(0)
        row = RowLayout(
            rows=1,
            length=width,
            width=width,
            sequences=tuple(bounds.tolist()),
            real_lengths=tuple(segments),
            context_parallel_size=size,
        )
        if case["split"] == "balanced":
            positions = tuple(row.held_by(r, torch.device("cpu")) for r in range(size))
        else:
            positions = torch.arange(width).chunk(size)
        segment = torch.bucketize(torch.arange(width), bounds[1:-1], right=True)
        layout = RingLayout(positions, segment, dist.group.WORLD, rank)
        generator = torch.Generator().manual_seed(case["seed"])
        rows, groups = case["rows"], case["groups"]
        q = torch.randn(rows, HEADS, width, DIM, generator=generator)
        k, v = (torch.randn(rows, groups, width, DIM, generator=generator) for _ in range(2))
        weights = torch.randn(rows, HEADS, width, DIM, generator=generator)
        scale = DIM**-0.5
        # the whole row, every position seeing what its row position and segment allow
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        relative = torch.arange(width)[None, :] - torch.arange(width)[:, None]
        mask = (relative <= 0) & (segment[None, :] == segment[:, None])
        if case["window"] is not None:
            mask &= relative >= -case["window"][0]
        repeat = HEADS // groups
        wide = [x.repeat_interleave(repeat, dim=1) for x in leaves[1:]]
        scores = (leaves[0] @ wide[0].transpose(-1, -2) * scale).masked_fill(~mask, -torch.inf)
        whole = scores.softmax(-1) @ wide[1]
        (whole * weights).sum().backward()
        # this rank's part through the ring
        mine = positions[rank]
        local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
        out = ring_attention(*local, layout, scale=scale, window=case["window"])
        (out * weights[:, :, mine]).sum().backward()
        report.append(
            {
                "out": float((out - whole[:, :, mine]).abs().max()),
                **{
                    name: float((part.grad - full.grad[:, :, mine]).abs().max())
                    for name, part, full in zip("qkv", local, leaves, strict=True)
                },
                "scale": float(whole.abs().max()),
            }
        )
    return report


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_ring_attention_equals_attention_over_the_whole_row(size: int, data: Any) -> None:
    drawn = data.draw(st.lists(cases(size), min_size=8, max_size=8))
    reports = run_ranks(attend_on_every_rank, size, drawn, timeout=240)
    for report in reports:
        for case, differences in zip(drawn, report, strict=True):
            # float32 sums over at most a row of 36 positions, of values of order 1-10
            for name in ("out", "q", "k", "v"):
                assert differences[name] < 1e-5 * max(1.0, differences["scale"]), (case, name)
