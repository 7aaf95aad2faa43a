"""Per-token log-probabilities and entropy straight from the final hidden states and the
(vocab-parallel) output weight: the output layer fused with ``heads.kernels.vocab_parallel``'s math,
so that the ``[tokens, vocab]`` logits never exist for the whole micro-batch.

The work is done in tiles of ``C`` tokens x ``B`` vocabulary rows of ``W``. Forward: a tile's
``logits = h_chunk @ W_block^T`` (a matmul in the weight's dtype, as the unfused output layer
computes it), then its per-token statistics in float32 with ``vocab_parallel``'s own chunk code
(``sum exp``, entropy term, relative to the tile's row max) and the target logit where the tile
holds it. Statistics relative to different maxima are combined by rescaling them to the larger
one (online softmax): over the blocks of a token chunk, then over the ranks of a
tensor-parallel group (one all-reduce MAX and one SUM: the same two collectives as
``vocab_parallel``). Only ``O(tokens)`` numbers are kept, besides ``h`` and ``W`` themselves.

Backward recomputes each tile's logits, turns them into their gradient in place with
``vocab_parallel.chunk_gradient``, and accumulates ``grad_h`` (over blocks, in float32) and
``grad_W`` (over token chunks, in the weight's dtype: each tile's matmul accumulates in float32,
a low-precision weight's gradient is rounded once per token chunk). One more matmul than the
unfused path (the recomputation): 4 instead of 3.

Tiles are large so that the matmuls run at full speed (``W_block`` is read once per token chunk:
``C`` in the thousands), and bounded so that the work buffers stay a small fraction of the
logits (:func:`default_tile`).

Under tensor parallelism ``grad_h`` is this rank's part (its vocabulary columns): the hidden
states are the input of a column-parallel layer, and the caller sums their gradient over the
group as that layer does (megatron's ``copy_to_tensor_model_parallel_region``, or the
sequence-parallel gather). Upstream gradients must be identical on every rank of the group (the
loss is computed redundantly), as for ``vocab_parallel``.

Memory: forward, one ``[C, B]`` buffer in the weight's dtype and one or two float32 ones;
backward, the same (one more float32 where the weight is not float32) plus the gradients of
``h`` and ``W`` and a float32 ``[C, hidden]`` accumulator.

For a token-separable loss (its gradient at a token depends on that token's log-prob and
entropy only) :func:`fused_log_probs_with_gradient` needs no recomputation: it keeps a token
chunk's tiles (``[C, V_local]`` in the weight's dtype), asks the loss for the chunk's upstream
gradients as soon as the chunk's log-probs are known, and computes the gradients of ``h`` and
``W`` from the kept tiles. Three matmuls, as the unfused layer; a zero-valued anchor added to
the loss hands the gradients over in backward. Its tiles and statistics are the forward's
above, so both give bit-identical log-probs and entropy.

:func:`fused_sum_pi_squared` gives each token's sum of squared probabilities (no gradient) from
the same tiles, computed once more, apart from the log-probs and entropy.

Every path walks the tiles one way (``_Tiles``), and the paths differ only in what they do with
a tile: fold its statistics into the chunk's (``_SoftmaxSums``, ``_PowerSums``: one online
softmax, ``_add_chunk``), or turn it into its gradient (``_Gradients``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from heads.kernels.vocab_parallel import (
    DEFAULT_CPU_CHUNK_ELEMENTS,
    MIN_TEMPERATURE,
    UpstreamGradients,
    all_reduce_over,
    check_targets,
    chunk_gradient,
    chunk_power_sums,
    chunk_statistics,
    finish_power_sums,
    finish_statistics,
    save_and_shape,
    target_columns,
    work_view,
)

__all__ = [
    "VOCAB_BLOCK",
    "UpstreamOf",
    "default_tile",
    "fused_log_probs_and_entropy",
    "fused_log_probs_with_gradient",
    "fused_sum_pi_squared",
]

VOCAB_BLOCK = 16384
"""Vocabulary rows of ``W`` per tile (fewer when the local vocabulary is smaller)."""

MIN_CHUNK_TOKENS = 128
"""The fewest tokens a default tile holds: its matmul keeps full tiles of rows for the
accelerator's matrix units."""

_TILES_PER_LOGITS = 16
"""A default tile holds at most 1/16 of the micro-batch's logits (but ``MIN_CHUNK_TOKENS``
rows): the work buffers stay a small fraction of what the whole logits would take."""

_ACCELERATOR_TILE_ELEMENTS = 1 << 24
"""On an accelerator a tile holds at most this many logits (64 MiB per float32 buffer): with
``VOCAB_BLOCK`` rows of ``W``, 1024 tokens, so that each block of ``W`` is read once per 1024
tokens and the matmuls are compute-bound (hidden 4096: 137 GFLOP a tile), and the chunk of
tiles :func:`fused_log_probs_with_gradient` keeps stays small (1024 tokens x 152K vocabulary:
0.3 GiB in bfloat16). The H200 figures in ``docs/fused-lm-head.md`` were measured with 2048
tokens (``1 << 25``)."""


def default_tile(n_tokens: int, vocab_local: int, device: torch.device) -> tuple[int, int]:
    """``(tokens, vocabulary rows)`` per tile: ``VOCAB_BLOCK`` rows (or the local vocabulary),
    and as many tokens as fit in ``DEFAULT_CPU_CHUNK_ELEMENTS`` logits on CPU,
    ``_ACCELERATOR_TILE_ELEMENTS`` elsewhere, and in 1/16 of the micro-batch's logits, but at
    least ``MIN_CHUNK_TOKENS``."""
    block = min(vocab_local, VOCAB_BLOCK)
    budget = DEFAULT_CPU_CHUNK_ELEMENTS if device.type == "cpu" else _ACCELERATOR_TILE_ELEMENTS
    budget = min(budget, n_tokens * vocab_local // _TILES_PER_LOGITS)
    return max(MIN_CHUNK_TOKENS, budget // block), block


def fused_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    tile: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_probs_and_entropy(hidden @ weight.T, targets, ...)`` without the logits.

    Args:
        hidden: ``[..., H]`` final hidden states (any float dtype; the matmul runs in the
            weight's dtype, the softmax statistics in float32).
        weight: ``[V_local, H]`` output weight; with ``group``, this rank's vocabulary rows
            ``[vocab_start, vocab_start + V_local)``.
        targets: ``[...]`` int64 token ids in the full vocabulary (outside ``[0, V)``: target
            logit 0, mask them out yourself).
        temperature, compute_entropy, group, vocab_start: as ``log_probs_and_entropy``.
        tile: ``(tokens, vocabulary rows)`` per tile; None: :func:`default_tile`.

    Returns:
        ``(log_probs, entropy)``, float32 ``[...]`` (entropy None when not computed); the
        log-probs are bit-identical with and without the entropy. Differentiable w.r.t.
        ``hidden`` (this rank's part under ``group``, see the module doc) and ``weight``.
    """
    _check_inputs(hidden, weight, targets, group, vocab_start)
    tile = _tile_for(tile, targets.numel(), weight)
    temp = max(float(temperature), MIN_TEMPERATURE)
    apply: Callable[..., Any] = _FusedLogProbsAndEntropy.apply
    outputs = apply(hidden, weight, targets, temp, compute_entropy, group, vocab_start, tile)
    if compute_entropy:
        log_probs, entropy = outputs
        return log_probs, entropy
    return outputs, None


UpstreamOf = Callable[
    [int, int, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor | None, torch.Tensor | None]
]
"""``upstream_of(start, end, log_probs, entropy) -> (g_log_probs, g_entropy)``: the loss's
gradient w.r.t. the log-probs and the entropy of the flat tokens ``[start, end)`` (None: no
gradient), from their values; see :func:`fused_log_probs_with_gradient`."""


def fused_log_probs_with_gradient(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    upstream_of: UpstreamOf,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    tile: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`fused_log_probs_and_entropy` for a loss whose gradient at a token depends on that
    token's log-prob and entropy only (a *token-separable* loss): the gradients of ``hidden``
    and ``weight`` are computed in this forward pass, chunk by chunk, while each chunk's
    logits exist, so the backward needs no recomputation (three matmuls, as the unfused
    output layer, instead of four).

    The tiles are :func:`fused_log_probs_and_entropy`'s (``tile``; None: :func:`default_tile`)
    and so is the arithmetic of the results, which are therefore bit-identical to its
    (without tensor parallelism, and with two ranks). A token chunk's tiles are computed and
    kept (``[C, V_local]`` in the weight's dtype), their statistics combined (under ``group``:
    all-reduced, MAX then SUM, per chunk), then ``upstream_of(start, end, log_probs,
    entropy)`` (identical on every rank of ``group``) gives the loss's gradients w.r.t. the
    chunk's results, each tile turns into its gradient in place, and ``grad_h = dlogits @ W``,
    ``grad_W += dlogits^T h_chunk``. Nothing is saved but the two gradients (as big as
    ``hidden`` and ``weight``; ``grad_W`` only where ``weight`` requires grad, e.g. not under
    LoRA).

    Returns:
        ``(log_probs, entropy, anchor)``: the results, float32 ``[...]`` and detached (entropy
        None when not computed), and a float32 zero whose backward delivers the gradients
        (times its upstream gradient) to ``hidden`` (this rank's part under ``group``, as
        :func:`fused_log_probs_and_entropy`'s) and ``weight``: add it to the loss computed from
        the results.
    """
    _check_inputs(hidden, weight, targets, group, vocab_start)
    flat, w = hidden.detach().reshape(-1, hidden.shape[-1]), weight.detach()
    tiles = _Tiles(flat, w, _tile_for(tile, flat.shape[0], w), keep_chunk=True)
    temp = max(float(temperature), MIN_TEMPERATURE)
    local_targets = targets.reshape(-1) - vocab_start
    log_probs = torch.empty(flat.shape[0], dtype=torch.float32, device=w.device)
    entropy = torch.empty_like(log_probs) if compute_entropy else None
    grad_h = torch.empty_like(flat) if hidden.requires_grad else None
    grad_w = torch.zeros_like(w) if weight.requires_grad else None
    sums = _SoftmaxSums(tiles, local_targets, temp, compute_entropy)
    # the gradient's work space: the statistics' float32 buffers
    work_buf = None if w.dtype == torch.float32 else sums.shifted_buf
    gradients = _Gradients(tiles, grad_h, grad_w, (work_buf, sums.exp_buf), temp)
    with torch.no_grad():
        for tokens, h_chunk in tiles.chunks():
            results = _chunk_results(tiles, sums, tokens, h_chunk, group)
            chunk_log_probs, log_sum, chunk_entropy, chunk_max = results
            log_probs[tokens] = chunk_log_probs
            if entropy is not None and chunk_entropy is not None:
                entropy[tokens] = chunk_entropy
            if grad_h is None and grad_w is None:
                continue
            g_lp, g_h = upstream_of(tokens.start, tokens.stop, chunk_log_probs, chunk_entropy)
            if g_lp is None and g_h is None:
                if grad_h is not None:
                    grad_h[tokens] = 0
                continue
            if g_h is not None and chunk_entropy is None:
                raise ValueError("upstream_of gave an entropy gradient, but no entropy is computed")
            _, elsewhere = target_columns(local_targets[tokens], 0, w.shape[0])
            upstream = UpstreamGradients((g_lp, g_h), chunk_entropy, elsewhere, temp)
            per_token = (chunk_max, -log_sum, local_targets[tokens])
            kept, at = tiles.tiles(h_chunk, computed=False), slice(0, h_chunk.shape[0])
            gradients.add_chunk(kept, h_chunk, tokens, at, upstream, per_token)
    del tiles, sums, gradients
    apply: Callable[..., Any] = _PrecomputedGradients.apply
    anchor, shape = apply(hidden, weight, grad_h, grad_w), hidden.shape[:-1]
    return log_probs.view(shape), None if entropy is None else entropy.view(shape), anchor


@torch.no_grad()
def fused_sum_pi_squared(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``vocab_parallel.sum_pi_squared(hidden @ weight.T, ...)`` without the logits: float32
    ``[...]``, no gradient. One more pass over :func:`fused_log_probs_and_entropy`'s tiles (one
    matmul each), the results of which it leaves untouched: per tile ``S = sum exp(s)`` and
    ``S2 = sum exp(s) ** 2`` relative to the tile's row max, combined over the blocks by
    rescaling (``exp(-d)``, ``exp(-2 d)``), then over the ranks of ``group`` as the
    log-sum-exp is. Arguments as :func:`fused_log_probs_and_entropy`'s; the memory, its
    forward's without the entropy."""
    _check_hidden_and_weight(hidden, weight)
    flat, w = hidden.detach().reshape(-1, hidden.shape[-1]), weight.detach()
    tiles = _Tiles(flat, w, _tile_for(tile, flat.shape[0], w))
    power_sums = _PowerSums(tiles, max(float(temperature), MIN_TEMPERATURE))
    sums, row_max = _statistics(tiles, power_sums)
    _combine_over_ranks(sums, row_max, power_sums.temp, group, _rebase_power_sums)
    return finish_power_sums(sums).view(hidden.shape[:-1])


class _PrecomputedGradients(torch.autograd.Function):
    """A float32 zero whose backward returns gradients computed beforehand (times its own
    upstream gradient) for ``hidden`` and ``weight``; once."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        grad_h: torch.Tensor | None,
        grad_w: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.gradients = (grad_h, grad_w)
        ctx.hidden_shape = hidden.shape
        return torch.zeros((), dtype=torch.float32, device=weight.device)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.gradients is None:
            raise RuntimeError(
                "the fused LM head's precomputed gradients were handed over already: its loss "
                "can be backpropagated once"
            )
        grad_h, grad_w = ctx.gradients
        ctx.gradients = None
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_output).view(ctx.hidden_shape)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_output)
        return grad_h, grad_w, None, None


def _check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup | None,
    vocab_start: int,
) -> None:
    _check_hidden_and_weight(hidden, weight)
    check_targets(targets, hidden.shape[:-1], "hidden", group, vocab_start)


def _check_hidden_and_weight(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(
            f"hidden and weight must be floating point, got {hidden.dtype}, {weight.dtype}"
        )
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V_local > 0, hidden], got {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dimension must be weight's hidden size {weight.shape[1]}, got "
            f"hidden {tuple(hidden.shape)}"
        )


def _tile_for(tile: tuple[int, int] | None, n_tokens: int, weight: torch.Tensor) -> tuple[int, int]:
    """``tile`` (ValueError unless both sizes are positive), or :func:`default_tile`."""
    if tile is None:
        return default_tile(n_tokens, weight.shape[0], weight.device)
    if min(tile) < 1:
        raise ValueError(f"tile sizes must be positive, got {tile}")
    return tile


Rebase = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]
"""``rebase(stats, row_max, new_max, temp)``: per-token statistics relative to ``row_max``
moved to ``new_max >= row_max``, in place."""


def _rebase(stats: torch.Tensor, row_max: torch.Tensor, new_max: torch.Tensor, temp: float) -> None:
    """Move ``stats`` (rows ``S``, target logit and, with the entropy, ``W``) from ``row_max`` to
    ``new_max >= row_max``, in place: ``d = (M - m) / T``, ``S' = exp(-d) S``,
    ``W' = exp(-d) (W - d S)``."""
    shift = (new_max - row_max).div_(temp)
    scale = torch.exp(-shift)
    if stats.shape[0] == 3:
        stats[2].sub_(shift * stats[0]).mul_(scale)
    stats[0].mul_(scale)


def _rebase_power_sums(
    sums: torch.Tensor, row_max: torch.Tensor, new_max: torch.Tensor, temp: float
) -> None:
    """:data:`Rebase` for ``sums`` rows ``S = sum exp(s)``, ``S2 = sum exp(s) ** 2``: ``S' =
    exp(-d) S``, ``S2' = exp(-d) ** 2 S2``."""
    scale = torch.exp((row_max - new_max).div_(temp))
    sums[0].mul_(scale)
    sums[1].mul_(scale.square_())


def _combine_over_ranks(
    stats: torch.Tensor,
    row_max: torch.Tensor,
    temp: float,
    group: dist.ProcessGroup | None,
    rebase: Rebase = _rebase,
) -> None:
    """Under ``group``, in place: every rank's per-token statistics made relative to the
    global row maximum (all-reduce MAX, then ``rebase``), then added up (all-reduce SUM)."""
    if group is None:
        return
    local_max = row_max.clone()
    all_reduce_over(row_max, dist.ReduceOp.MAX, group)
    rebase(stats, local_max, row_max, temp)
    all_reduce_over(stats, dist.ReduceOp.SUM, group)


def _fold(
    running: tuple[torch.Tensor, torch.Tensor],
    tile: tuple[torch.Tensor, torch.Tensor],
    temp: float,
    rebase: Rebase,
    rows: tuple[int, ...],
    first: bool,
) -> None:
    """Fold a tile's per-token statistics ``tile = (stats, row_max)`` (rows ``rows`` of
    ``stats``) into the running ones, in place: the first tile starts them, later ones are
    combined by rescaling both to the larger maximum (online softmax)."""
    (stats, row_max), (tile_stats, tile_max) = running, tile
    if first:
        for row in rows:
            stats[row].copy_(tile_stats[row])
        row_max.copy_(tile_max)
        return
    new_max = torch.maximum(row_max, tile_max)
    rebase(stats, row_max, new_max, temp)
    rebase(tile_stats, tile_max, new_max, temp)
    for row in rows:
        stats[row].add_(tile_stats[row])
    row_max.copy_(new_max)


def _blocks(vocab_local: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, vocab_local)) for start in range(0, vocab_local, block)]


class _Tiles:
    """The work every path shares: the tiles of ``hidden @ weight.T`` (``C`` tokens x ``B``
    vocabulary rows, in the weight's dtype) computed into one buffer, a tile's or, with
    ``keep_chunk``, a token chunk's (``[C, V_local]``: its tiles side by side, kept until the
    next chunk), and float32 work buffers of a tile's size."""

    def __init__(
        self,
        flat: torch.Tensor,
        weight: torch.Tensor,
        tile: tuple[int, int],
        *,
        keep_chunk: bool = False,
    ) -> None:
        chunk, block = tile
        n_tokens, vocab_local = flat.shape[0], weight.shape[0]
        self.flat, self.weight, self.chunk, self.keep_chunk = flat, weight, chunk, keep_chunk
        self.blocks = _blocks(vocab_local, block)
        self.rows, self.columns = min(chunk, n_tokens), min(block, vocab_local)
        width = vocab_local if keep_chunk else self.columns
        self.logits_buf = torch.empty(self.rows * width, dtype=weight.dtype, device=weight.device)

    def float32(self) -> torch.Tensor:
        """A float32 work buffer of a tile's size."""
        return torch.empty(self.rows * self.columns, dtype=torch.float32, device=self.weight.device)

    def chunks(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """Each token chunk: its tokens and their hidden states in the weight's dtype."""
        n_tokens = self.flat.shape[0]
        for start in range(0, n_tokens, self.chunk):
            tokens = slice(start, min(start + self.chunk, n_tokens))
            yield tokens, self.flat[tokens].to(self.weight.dtype)

    def tiles(
        self, h_chunk: torch.Tensor, *, computed: bool = True
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """A token chunk's tiles ``(first, last, logits [C, last - first])`` over the vocabulary
        rows ``[first, last)``: computed (one matmul each), or (``computed=False``, with
        ``keep_chunk``) as the chunk's walk left them."""
        size = h_chunk.shape[0]
        for first, last in self.blocks:
            at = size * first if self.keep_chunk else 0
            logits = work_view(self.logits_buf[at:], size, last - first)
            if computed:
                torch.mm(h_chunk, self.weight[first:last].t(), out=logits)
            yield first, last, logits


class _TileStatistic:
    """Per-token statistics of the tiles relative to a row max, with their work buffers: a
    tile's computed by :meth:`of_tile`, the rows ``folded`` rescaled by ``rebase`` and added
    over the blocks (the others added as they are)."""

    def __init__(
        self, tiles: _Tiles, temp: float, rows: int, folded: tuple[int, ...], rebase: Rebase
    ) -> None:
        self.temp, self.rows, self.folded, self.rebase = temp, rows, folded, rebase
        device = tiles.weight.device
        self.scratch = torch.empty(rows, tiles.rows, dtype=torch.float32, device=device)
        self.shifted_buf = tiles.float32()

    def of_tile(
        self, logits: torch.Tensor, tokens: slice, first: int, stats: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A tile's ``(statistics, row max)`` (``[C, B]`` logits of ``tokens`` from the
        vocabulary row ``first``); ``stats``: its token chunk's running ones."""
        raise NotImplementedError


class _SoftmaxSums(_TileStatistic):
    """The log-probs' and entropy's: rows ``S``, the target logit (0 where no tile here holds
    it) and, with the entropy, ``W``; a tile's from ``vocab_parallel``'s own chunk code."""

    def __init__(
        self, tiles: _Tiles, local_targets: torch.Tensor, temp: float, compute_entropy: bool
    ) -> None:
        rows, folded = (3, (0, 2)) if compute_entropy else (2, (0,))
        super().__init__(tiles, temp, rows, folded, _rebase)
        self.local_targets = local_targets
        self.exp_buf = tiles.float32() if compute_entropy else None

    def of_tile(
        self, logits: torch.Tensor, tokens: slice, first: int, stats: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the target logit, added as it is (relative to no maximum)
        col, outside = target_columns(self.local_targets[tokens], first, logits.shape[1])
        stats[1] += logits.gather(1, col[:, None]).squeeze(1).masked_fill_(outside, 0)
        tile_max = logits.amax(dim=-1).to(torch.float32)
        here = self.scratch[:, : logits.shape[0]]
        entropy_terms = here[2] if self.rows == 3 else None
        chunk_statistics(
            logits, tile_max, self.temp, here[0], entropy_terms, self.shifted_buf, self.exp_buf
        )
        return here, tile_max


class _PowerSums(_TileStatistic):
    """``sum_pi_squared``'s: rows ``S = sum exp(s)`` and ``S2 = sum exp(s) ** 2``."""

    def __init__(self, tiles: _Tiles, temp: float) -> None:
        super().__init__(tiles, temp, 2, (0, 1), _rebase_power_sums)

    def of_tile(
        self, logits: torch.Tensor, tokens: slice, first: int, stats: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tile_max = logits.amax(dim=-1).to(torch.float32)
        here = self.scratch[:, : logits.shape[0]]
        chunk_power_sums(logits, tile_max, self.temp, here, self.shifted_buf)
        return here, tile_max


def _add_chunk(
    tiles: _Tiles,
    statistic: _TileStatistic,
    tokens: slice,
    h_chunk: torch.Tensor,
    stats: torch.Tensor,
    row_max: torch.Tensor,
) -> None:
    """A token chunk's per-token ``stats``, relative to ``row_max`` (both written in place),
    from its tiles: the first tile's start them, later ones are combined by rescaling to the
    larger maximum (online softmax)."""
    for first, _, logits in tiles.tiles(h_chunk):
        tile = statistic.of_tile(logits, tokens, first, stats)
        running = (stats, row_max)
        _fold(running, tile, statistic.temp, statistic.rebase, statistic.folded, first == 0)


def _chunk_results(
    tiles: _Tiles,
    sums: _SoftmaxSums,
    tokens: slice,
    h_chunk: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A token chunk's ``(log_probs, log_sum, entropy, row_max)``, its statistics combined over
    the ranks of ``group``."""
    size, device = h_chunk.shape[0], tiles.weight.device
    stats = torch.zeros(sums.rows, size, dtype=torch.float32, device=device)
    row_max = torch.empty(size, dtype=torch.float32, device=device)
    _add_chunk(tiles, sums, tokens, h_chunk, stats, row_max)
    _combine_over_ranks(stats, row_max, sums.temp, group)
    return (*finish_statistics(stats, row_max, sums.temp), row_max)


def _statistics(tiles: _Tiles, statistic: _TileStatistic) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's ``(stats, row_max)``, chunk by chunk (this rank's vocabulary rows)."""
    n_tokens, device = tiles.flat.shape[0], tiles.weight.device
    stats = torch.zeros(statistic.rows, n_tokens, dtype=torch.float32, device=device)
    row_max = torch.empty(n_tokens, dtype=torch.float32, device=device)
    for tokens, h_chunk in tiles.chunks():
        _add_chunk(tiles, statistic, tokens, h_chunk, stats[:, tokens], row_max[tokens])
    return stats, row_max


class _Gradients:
    """The gradients of ``h`` (rows of ``grad_h``, through a float32 ``[C, hidden]``
    accumulator over the blocks) and ``W`` (``grad_w``, accumulated over the token chunks in
    its dtype) from the tiles, each turned into its gradient in place with
    ``vocab_parallel.chunk_gradient``; ``buffers``: its float32 work and probability buffers."""

    def __init__(
        self,
        tiles: _Tiles,
        grad_h: torch.Tensor | None,
        grad_w: torch.Tensor | None,
        buffers: tuple[torch.Tensor | None, torch.Tensor | None],
        temp: float,
    ) -> None:
        self.weight, self.grad_h, self.grad_w = tiles.weight, grad_h, grad_w
        self.buffers, self.temp = buffers, temp
        hidden_size, device = tiles.flat.shape[1], tiles.weight.device
        self.total = (
            None
            if grad_h is None
            else torch.empty(tiles.rows, hidden_size, dtype=torch.float32, device=device)
        )

    def add_chunk(
        self,
        tiles: Iterable[tuple[int, int, torch.Tensor]],
        h_chunk: torch.Tensor,
        tokens: slice,
        at: slice,
        upstream: UpstreamGradients,
        per_token: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        """Add the gradients from a token chunk's ``tiles`` (its tokens ``tokens``; ``at`` in
        ``upstream`` and the per-token ``per_token = (row_max, -log_sum, local targets)``)."""
        row_max, neg_log_sum, local_targets = per_token
        here = None if self.total is None else self.total[: h_chunk.shape[0]].zero_()
        for first, last, logits in tiles:
            col, outside = target_columns(local_targets[at], first, logits.shape[1])
            one_hot = upstream.target_grad[at].masked_fill(outside[:, None], 0)
            chunk_gradient(
                logits, at, upstream, row_max, neg_log_sum, col[:, None], one_hot, self.temp,
                logits, *self.buffers,
            )  # fmt: skip
            w_block = self.weight[first:last]
            if here is not None:
                if logits.dtype == torch.float32:
                    here.addmm_(logits, w_block)
                else:
                    here.add_(torch.mm(logits, w_block))
            if self.grad_w is not None:
                self.grad_w[first:last].addmm_(logits.t(), h_chunk)
        if self.grad_h is not None and here is not None:
            self.grad_h[tokens] = here


class _FusedLogProbsAndEntropy(torch.autograd.Function):
    """Saves ``hidden``, ``weight`` (no copies) and per-token ``max``, ``log(sum exp)``, entropy
    (notation of ``vocab_parallel._LogProbsAndEntropy``)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temp: float,
        compute_entropy: bool,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        tile: tuple[int, int],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        flat = hidden.reshape(-1, hidden.shape[-1])
        local_targets = targets.reshape(-1) - vocab_start
        tiles = _Tiles(flat, weight, tile)
        sums = _SoftmaxSums(tiles, local_targets, temp, compute_entropy)
        stats, row_max = _statistics(tiles, sums)
        del tiles, sums
        _combine_over_ranks(stats, row_max, temp, group)
        log_probs, log_sum, entropy = finish_statistics(stats, row_max, temp)

        ctx.temp = temp
        ctx.tile = tile
        saved = [hidden, weight, local_targets, row_max]
        return save_and_shape(ctx, saved, log_probs, log_sum, entropy, hidden.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local_targets, row_max, log_sum, *rest = ctx.saved_tensors
        no_grads = (None,) * 6
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        if all(g is None for g in grads) or not (want_hidden or want_weight):
            return (None, None, *no_grads)
        flat = hidden.reshape(-1, hidden.shape[-1])
        _, elsewhere = target_columns(local_targets, 0, weight.shape[0])
        upstream = UpstreamGradients(grads, rest[0] if rest else None, elsewhere, ctx.temp)
        per_token = (row_max, -log_sum, local_targets)
        grad_hidden = torch.empty_like(flat) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        tiles = _Tiles(flat, weight, ctx.tile)
        # the logits' buffer receives their gradient in place; float32 work space beside it
        # where the weight is not float32, and for the probabilities when the entropy has one
        work_buf = None if weight.dtype == torch.float32 else tiles.float32()
        prob_buf = None if upstream.slope is None else tiles.float32()
        gradients = _Gradients(tiles, grad_hidden, grad_weight, (work_buf, prob_buf), ctx.temp)
        for tokens, h_chunk in tiles.chunks():
            gradients.add_chunk(tiles.tiles(h_chunk), h_chunk, tokens, tokens, upstream, per_token)
        grad_h = None if grad_hidden is None else grad_hidden.view(hidden.shape)
        return (grad_h, grad_weight, *no_grads)
