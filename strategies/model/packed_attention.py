"""Causal attention over a packed row, sequence by sequence, and the positions of its tokens:
what every backend's packed micro-batches need (megatron's local layer spec, the fsdp2 backend's
transformers models).

Each sequence runs through ``scaled_dot_product_attention`` alone (causal, 4-D input, so the CPU
picks its fused kernel, which also skips the causal half): attention never crosses a sequence
boundary and the cost grows with the sum of the squared sequence lengths, not the squared row
length; no ``[T, T]`` mask is ever built.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

#: A sliding window as megatron spells it: each query sees keys ``i - left`` to ``i + right``.
Window = tuple[int, int]


def attend_per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: Sequence[int],
    *,
    scale: float | None,
    window: Window | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``query`` ``[1, heads, T, dim]``, ``key``/``value`` ``[1, groups, T, dim]`` (grouped
    heads allowed) -> ``[1, heads, T, dim]``, causal inside each segment ``bounds[i]`` to
    ``bounds[i + 1]`` (host ints from 0 to T), within ``window`` where given."""
    pieces = []
    for start, end in itertools.pairwise(bounds):
        q, k, v = (x[:, :, start:end] for x in (query, key, value))
        length = end - start
        mask = None if window is None or _is_causal(window, length) else _window(length, window, q)
        pieces.append(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        )
    return torch.cat(pieces, dim=2)


def _is_causal(window: Window, length: int) -> bool:
    """Whether ``window`` lets every query of a ``length``-token sequence see what plain causal
    attention does (so the fused causal kernel runs, with no mask)."""
    return window[0] >= length - 1 and window[1] == 0


def _window(length: int, window: Window, like: torch.Tensor) -> torch.Tensor:
    """Which keys each query of a ``length``-token sequence sees under ``window`` (True:
    attended), as megatron's local mask and transformers' sliding-window mask say."""
    offsets = torch.arange(length, device=like.device)
    relative = offsets[None, :] - offsets[:, None]  # key - query
    return (relative >= -window[0]) & (relative <= window[1])


def row_segments(offsets: Sequence[int], width: int) -> tuple[int, ...]:
    """The segments of a packed row of ``width`` tokens whose sequences start at ``offsets``
    (``[b + 1]``): the row's padding past the last sequence is one more segment, so no sequence
    attends to it."""
    bounds = tuple(int(offset) for offset in offsets)
    return (*bounds, width) if width > bounds[-1] else bounds


def positions_in_sequences(bounds: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its own sequence, ``[bounds[-1]]`` int64, for a row whose
    segments start at ``bounds[:-1]`` (0 at every segment start)."""
    bounds = bounds.to(torch.long)
    lengths = bounds.diff()
    starts = torch.repeat_interleave(bounds[:-1], lengths)
    return torch.arange(int(bounds[-1]), dtype=torch.long, device=bounds.device) - starts
