"""Context parallelism on megatron's local layer spec: each sequence split over the
context-parallel ranks in megatron's load-balanced layout, attention exact across the parts.

Layout (megatron's, the one its rotary embedding assumes): each segment of a row (the whole row
when padded; each sequence, and the row's padding, when packed, every sequence padded to a
multiple of ``2 x CP``) is cut into ``2 x CP`` chunks; rank ``r`` holds chunks ``r`` and
``2 x CP - 1 - r`` of every segment, so every rank gets as much of the causal attention's work
as any other. The model runs on each rank's ``width / CP`` tokens.

Attention, two ways (``MegatronBackend.context_parallel_attention``):

- ``all_gather`` (the default): every rank all-gathers the keys and values of the whole row
  (their gradient is reduce-scattered back) and attends with its own queries under the causal
  mask of their global positions inside their own segment (the document mask), as Llama 3's
  long-context training did, through SDPA's fused kernel. Only K and V (``2 x groups x
  head_dim`` per token, a fraction of the hidden size with grouped-query attention) and that
  ``[queries, row]`` mask are held whole.
- ``ring``: ring attention (``strategies.parallel.ring_attention``): the keys and values go
  round the ranks one rank's block at a time; each rank attends its queries to each block under
  that mask, built per block and query tile from the positions, folding the blocks into a
  running softmax; backward goes round again. Nothing is held whole; slower on a CPU (its
  scores are plain tensor operations, not a fused kernel).

The micro-batch's :class:`Layout` (what each rank holds, the gather's order, the segments) is
built once per micro-batch and read by every layer (:class:`ContextAttention`, handed down in
megatron's ``packed_seq_params``).

Outputs: the head runs on the last stage's output of this rank's tokens (the hidden states a
fused head reads, logits, or values; ``heads.base.SequenceSplit``), and only its per-token
results (one number per token and result) are gathered into the caller's layout, so the logits
of a rank never exceed its own tokens; a head that cannot run position by position gets its raw
output gathered instead. Every context-parallel rank then computes the same loss from the
gathered results; the loss that goes backward is divided by CP and the gather's backward sums
the ranks' gradients (reduce-scatter), so each rank's share is its own tokens' gradient once,
and the output layer's gradient, from each rank's own tokens, adds up over the data x context
parallel gradient reduction.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import attrs
import torch
import torch.distributed as dist

from heads.base import SequenceSplit
from strategies.model.row_layout import RowLayout
from strategies.parallel.ring_attention import RingLayout, Window, visible_keys
from strategies.parallel.sequence_split import gather_sequence


@attrs.frozen
class Layout:
    """How one micro-batch's rows (``row``) are split over the context-parallel ``group``, as
    this rank ``rank`` sees it."""

    row: RowLayout
    rank: int
    device: torch.device
    group: Any = None

    @classmethod
    def over(cls, row: RowLayout, group: Any, device: torch.device) -> Layout:
        """The layout of ``row`` over the context-parallel ``group``, for this rank."""
        assert dist.get_world_size(group) == row.context_parallel_size
        return cls(row, dist.get_rank(group), device, group)

    @property
    def size(self) -> int:
        return self.row.context_parallel_size

    @functools.cached_property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """Each rank's positions, in its order."""
        return tuple(self.row.held_by(rank, self.device) for rank in range(self.size))

    @property
    def local(self) -> torch.Tensor:
        """This rank's positions."""
        return self.parts[self.rank]

    @functools.cached_property
    def order(self) -> torch.Tensor:
        """The positions of the ranks' parts one after another (what an all-gather joins)."""
        return torch.cat(self.parts)

    def split(self, whole: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of ``whole`` along ``dim`` (no gradient exchange)."""
        return whole.index_select(dim, self.local)

    def gather(self, part: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part (along ``dim``) joined with the other ranks' into the row's order;
        the gradient of each rank's part sums every rank's gradient."""
        return gather_sequence(part, self.group, dim, self.order)

    def head_split(self) -> SequenceSplit:
        """What the head is told of this rank's part of the last stage's output."""
        return self.row.split(self.local, self.group, self.order)

    @functools.cached_property
    def segments(self) -> torch.Tensor:
        """Each row position's segment (attention stays inside one)."""
        bounds = torch.tensor(self.row.bounds[1:-1], device=self.device)
        return torch.bucketize(torch.arange(self.row.width, device=self.device), bounds, right=True)

    def ring(self) -> RingLayout:
        """The ring attention's layout: every rank's positions, each row position's segment."""
        return RingLayout(self.parts, self.segments, self.group, self.rank)

    def visible_keys(self, window: Window) -> torch.Tensor:
        """``[local queries, row]``: the keys of the whole row each of this rank's queries
        attends (``ring_attention.visible_keys``, with megatron's sliding ``window``)."""
        keys = torch.arange(self.row.width, device=self.device)
        return visible_keys(self.local, keys, self.segments, window)


@attrs.define
class ContextAttention:
    """What every layer's context-parallel attention reads of one micro-batch's forward, built
    once per micro-batch and shared by every layer (the forward's parameters carry it; nothing
    keeps it afterwards): its layout, and the ring's where the keys and values go round the
    ranks (``ring``), else the keys each of this rank's queries sees in the gathered row, built
    once per sliding window by the first layer that asks."""

    layout: Layout
    #: Ring attention's layout; None: the keys and values are all-gathered.
    ring: RingLayout | None = None
    _visible: dict[Window, torch.Tensor] = attrs.field(factory=dict, init=False)

    def visible_keys(self, window: Window) -> torch.Tensor:
        """:meth:`Layout.visible_keys`, built on the first layer that asks."""
        if window not in self._visible:
            self._visible[window] = self.layout.visible_keys(window)
        return self._visible[window]


def row_params(
    row: RowLayout,
    device: torch.device,
    *,
    host_offsets: bool,
    context: Layout | None,
    ring: bool = False,
) -> Any:
    """The ``packed_seq_params`` megatron hands every layer for ``row``: a packed row's
    ``thd`` offsets (its segments; on the host with ``host_offsets``); with ``context``, the
    :class:`ContextAttention` the local core attention reads, ring attention's with ``ring``
    (right-padded rows: megatron's ``sbhd`` layout with the row's width, what its rotary
    embedding computes without them); None for right-padded rows without it.

    ``host_offsets``: on the local layer spec nothing needs the offsets on the device, and
    megatron's rotary embedding for thd reads them as host numbers (``tolist()``, ``item()``,
    twice per layer and micro-batch): on the device each read would wait for it; the local core
    attention splits the row by them too. TransformerEngine's attention takes them on the
    device."""
    attention = None
    if context is not None:
        attention = ContextAttention(context, context.ring() if ring else None)
    if not row.packed:
        if attention is None:
            return None
        width = row.width
        return _params_class()(
            qkv_format="sbhd", max_seqlen_q=width, max_seqlen_kv=width, context=attention
        )
    bounds = torch.tensor(row.bounds, dtype=torch.int32)
    if not host_offsets:
        bounds = bounds.to(device, non_blocking=True)
    longest = row.longest
    return _params_class()(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        context=attention,
    )


@functools.cache
def _params_class() -> type:
    """megatron's ``PackedSeqParams`` with the micro-batch's :class:`ContextAttention` (built
    once, on first use, so megatron is imported lazily)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclasses.dataclass
    class RowParams(PackedSeqParams):  # type: ignore[misc, unused-ignore]
        context: ContextAttention | None = None

    return RowParams
