"""Ring attention: each rank's queries over the keys and values of a row split over a group of
ranks, without any rank holding the whole row's keys and values or a ``[queries, row]`` mask.

Every rank holds some positions of each row (any split: megatron's load-balanced chunks,
contiguous parts). The keys and values go round the ring, one rank's block at a time: at each
step a rank attends its queries to the block it holds (scores and mask ``[queries, block]``,
the mask built from the positions and segments of both, causal inside each segment, within a
sliding window where given) and folds the result into a running softmax (the running maximum,
the running sum of exponentials, the weighted values), then passes the block on. Backward does
the same round again with the saved log-sum-exp: each rank adds its queries' share of the
block's key and value gradients, which travel with the block and arrive back at its owner
after a full round. Peak memory per layer: the local queries, two blocks in flight and one tile
of scores (a bounded number of query rows against the block), instead of the whole row's keys
and values and a ``[queries, row]`` mask.

Results equal ``softmax(q k^T * scale + mask) v`` over the whole row within float32 rounding
(the blocks' partial sums are added in another order). No attention dropout: a dropout mask
would have to be drawn per block as one call over the whole row draws it.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

from strategies.parallel.collectives import collective_device

#: A sliding window: each query sees keys ``i - left`` to ``i + right`` (megatron's).
Window = tuple[int, int] | None


@attrs.frozen
class RingLayout:
    """Where a ring's ranks' positions are: ``positions[r]`` the row positions rank ``r``
    holds (in its order), ``segments`` the segment of every row position (attention stays inside
    one), the ``group`` and this rank's place in it."""

    positions: tuple[torch.Tensor, ...]
    segments: torch.Tensor
    group: Any
    rank: int

    @property
    def size(self) -> int:
        return len(self.positions)

    def visible(self, source: int, window: Window) -> torch.Tensor:
        """``[this rank's positions, source's positions]``: :func:`visible_keys`."""
        return visible_keys(
            self.positions[self.rank], self.positions[source], self.segments, window
        )


def visible_keys(
    queries: torch.Tensor, keys: torch.Tensor, segments: torch.Tensor, window: Window
) -> torch.Tensor:
    """``[queries, keys]`` (row positions) True where the query attends the key: causal in row
    positions, inside the query's segment (``segments``: each row position's), within a sliding
    ``window`` (left, right) where given."""
    relative = keys[None, :] - queries[:, None]  # key - query
    seen = (relative <= 0) & (segments[keys][None, :] == segments[queries][:, None])
    if window is not None:
        seen &= relative >= -window[0]
    return seen


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: RingLayout,
    *,
    scale: float,
    window: Window = None,
) -> torch.Tensor:
    """``query`` ``[b, heads, n, dim]``, ``key`` / ``value`` ``[b, groups, n, dim]`` (this
    rank's positions, ``heads`` a multiple of ``groups``) -> the attention output
    ``[b, heads, n, dim]`` over the whole row (collective over ``layout.group``)."""
    out: torch.Tensor = _RingAttention.apply(query, key, value, layout, scale, window)
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layout: RingLayout,
        scale: float,
        window: Window,
    ) -> torch.Tensor:
        repeat = query.shape[1] // key.shape[1]
        q = query.float()
        top = torch.full(query.shape[:-1], float("-inf"), device=query.device)
        total = torch.zeros(query.shape[:-1], device=query.device)
        weighted = torch.zeros(q.shape[:-1] + value.shape[-1:], device=query.device)
        ring = _Ring(layout)
        held: tuple[torch.Tensor, ...] = (key, value)
        for step in range(layout.size):
            k, v = held
            if step < layout.size - 1:
                ring.start(held)  # the next block comes in while this one is used
            seen = layout.visible(ring.source(step), window).to(query.device)
            wide_k, wide_v = _expand(k.float(), repeat), _expand(v.float(), repeat)
            for rows in _tiles(seen, q.shape[0] * q.shape[1]):
                scores = _scores(q[:, :, rows], wide_k, scale, seen[rows])
                old = top[..., rows]
                new_top = torch.maximum(old, scores.amax(-1))
                # a query that has seen no key yet keeps -inf: its old sums are 0 anyway
                fade = torch.exp(torch.where(new_top == old, 0.0, old - new_top))
                probs = torch.exp(scores - new_top[..., None].nan_to_num(neginf=0.0))
                total[..., rows] = total[..., rows] * fade + probs.sum(-1)
                weighted[..., rows, :] = weighted[..., rows, :] * fade[..., None] + probs @ wide_v
                top[..., rows] = new_top
            if step < layout.size - 1:
                held = ring.finish()
        out = weighted / total[..., None]
        ctx.save_for_backward(query, key, value, out, top + torch.log(total))
        ctx.layout, ctx.scale, ctx.window, ctx.repeat = layout, scale, window, repeat
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, out, log_total = ctx.saved_tensors
        layout, scale, repeat = ctx.layout, ctx.scale, ctx.repeat
        q, grad = query.float(), grad_out.float()
        delta = (grad * out).sum(-1)  # [b, heads, n]
        grad_q = torch.zeros_like(q)
        ring = _Ring(layout)
        # the block's key and value gradients travel with it: after a full round (one pass
        # more than the forward's) they are back at its owner, every rank's share added
        held: tuple[torch.Tensor, ...] = (
            key,
            value,
            torch.zeros(key.shape, device=key.device),
            torch.zeros(value.shape, device=value.device),
        )
        for step in range(layout.size):
            k, v, grad_k, grad_v = held
            seen = layout.visible(ring.source(step), ctx.window).to(query.device)
            wide_k, wide_v = _expand(k.float(), repeat), _expand(v.float(), repeat)
            for rows in _tiles(seen, q.shape[0] * q.shape[1]):
                part = q[:, :, rows]
                scores = _scores(part, wide_k, scale, seen[rows])
                probs = torch.exp(scores - log_total[..., rows, None])
                grad_part = grad[:, :, rows]
                grad_v += _fold(probs.transpose(-1, -2) @ grad_part, repeat)
                spread = grad_part @ wide_v.transpose(-1, -2) - delta[..., rows, None]
                grad_scores = probs * spread
                grad_q[:, :, rows] += grad_scores @ wide_k * scale
                grad_k += _fold(grad_scores.transpose(-1, -2) @ part, repeat) * scale
            last = step == layout.size - 1
            if layout.size > 1:
                # the last pass takes the gradients home, the blocks themselves are done
                ring.start((grad_k, grad_v) if last else (k, v, grad_k, grad_v))
                held = ring.finish()
        key_grad, value_grad = held[-2:]
        return (
            grad_q.to(query.dtype),
            key_grad.to(key.dtype),
            value_grad.to(value.dtype),
            None,
            None,
            None,
        )


#: Scores a tile of queries holds at most (float32: 16 MiB), whatever the block's length.
TILE_ELEMENTS = 1 << 22


def _tiles(seen: torch.Tensor, heads: int) -> list[slice]:
    """The query rows of a block in tiles of at most :data:`TILE_ELEMENTS` scores (``heads``:
    rows x heads per query), leaving out the tiles that see none of the block's keys."""
    queries, keys = seen.shape
    step = max(1, TILE_ELEMENTS // max(1, heads * keys))
    tiles = [slice(start, min(start + step, queries)) for start in range(0, queries, step)]
    return [rows for rows in tiles if bool(seen[rows].any())]


def _scores(
    q: torch.Tensor, wide_k: torch.Tensor, scale: float, seen: torch.Tensor
) -> torch.Tensor:
    """Scaled scores ``[b, heads, n, block]``, -inf where the query does not see the key."""
    scores = q @ wide_k.transpose(-1, -2) * scale
    return scores.masked_fill(~seen, float("-inf"))


def _expand(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """Each key / value group repeated for its ``repeat`` query heads."""
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def _fold(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: each group's heads summed."""
    if repeat == 1:
        return x
    return x.unflatten(1, (-1, repeat)).sum(2)


class _Ring:
    """One rank's place in the ring: the block it holds at each step comes from ``source``;
    ``start`` sends what it holds to the next rank and receives the previous rank's (same
    shapes), ``finish`` waits and returns what arrived."""

    def __init__(self, layout: RingLayout) -> None:
        self.layout = layout
        size, rank, group = layout.size, layout.rank, layout.group
        self.after = dist.get_global_rank(group, (rank + 1) % size) if size > 1 else rank
        self.before = dist.get_global_rank(group, (rank - 1) % size) if size > 1 else rank
        self.wire = collective_device(group) if size > 1 else torch.device("cpu")
        self._pending: tuple[list[Any], torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def source(self, step: int) -> int:
        return (self.layout.rank - step) % self.layout.size

    def start(self, held: tuple[torch.Tensor, ...]) -> None:
        outgoing = torch.cat([t.detach().reshape(-1).float() for t in held]).to(self.wire)
        incoming = torch.empty_like(outgoing)
        requests = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, outgoing, self.after, self.layout.group),
                dist.P2POp(dist.irecv, incoming, self.before, self.layout.group),
            ]
        )
        self._pending = (requests, incoming, held)
        self._outgoing = outgoing  # kept alive until the send completes

    def finish(self) -> tuple[torch.Tensor, ...]:
        assert self._pending is not None
        requests, incoming, held = self._pending
        for request in requests:
            request.wait()
        self._pending = None
        pieces = incoming.to(held[0].device).split([t.numel() for t in held])
        return tuple(piece.view(t.shape).to(t.dtype) for piece, t in zip(pieces, held, strict=True))
