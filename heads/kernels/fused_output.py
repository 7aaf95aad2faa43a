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
"""

from __future__ import annotations

from collections.abc import Callable
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
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    w = weight.detach()
    n_tokens, vocab_local = flat.shape[0], w.shape[0]
    chunk, block = _tile_for(tile, n_tokens, w)
    blocks = _blocks(vocab_local, block)
    temp = max(float(temperature), MIN_TEMPERATURE)
    device, dtype, f32 = w.device, w.dtype, torch.float32
    local_targets = targets.reshape(-1) - vocab_start
    log_probs = torch.empty(n_tokens, dtype=f32, device=device)
    entropy = torch.empty_like(log_probs) if compute_entropy else None
    grad_h = torch.empty_like(flat) if hidden.requires_grad else None
    grad_w = torch.zeros_like(w) if weight.requires_grad else None

    rows, columns = min(chunk, n_tokens), min(block, vocab_local)
    rows_of_stats = 3 if compute_entropy else 2
    kept = torch.empty(rows * vocab_local, dtype=dtype, device=device)  # a chunk's tiles
    scratch = torch.empty(rows_of_stats, rows, dtype=f32, device=device)
    shifted_buf = torch.empty(rows * columns, dtype=f32, device=device)
    exp_buf = torch.empty_like(shifted_buf) if compute_entropy else None
    total = (
        torch.empty(rows, flat.shape[1], dtype=f32, device=device) if grad_h is not None else None
    )
    with torch.no_grad():
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            size = end - start
            h_chunk = flat[start:end].to(dtype)
            chunk_stats = torch.zeros(rows_of_stats, size, dtype=f32, device=device)
            chunk_max = torch.empty(size, dtype=f32, device=device)
            tiles = []
            for first, last in blocks:
                logits = torch.mm(
                    h_chunk,
                    w[first:last].t(),
                    out=kept[size * first : size * last].view(size, last - first),
                )
                running = (chunk_stats, chunk_max, scratch[:, :size])
                _add_tile(
                    logits, local_targets[start:end], first, temp, running, shifted_buf, exp_buf
                )
                tiles.append(logits)
            _combine_over_ranks(chunk_stats, chunk_max, temp, group)
            chunk_log_probs, log_sum, chunk_entropy = finish_statistics(
                chunk_stats, chunk_max, temp
            )
            log_probs[start:end] = chunk_log_probs
            if entropy is not None and chunk_entropy is not None:
                entropy[start:end] = chunk_entropy
            if grad_h is None and grad_w is None:
                continue
            g_lp, g_h = upstream_of(start, end, chunk_log_probs, chunk_entropy)
            if g_lp is None and g_h is None:
                if grad_h is not None:
                    grad_h[start:end] = 0
                continue
            if g_h is not None and chunk_entropy is None:
                raise ValueError("upstream_of gave an entropy gradient, but no entropy is computed")
            _, elsewhere = target_columns(local_targets[start:end], 0, vocab_local)
            upstream = UpstreamGradients((g_lp, g_h), chunk_entropy, elsewhere, temp)
            tokens, per_token = slice(0, size), (chunk_max, -log_sum, local_targets[start:end])
            here = None if total is None else total[:size].zero_()
            for (first, last), logits in zip(blocks, tiles, strict=True):
                _tile_gradient(
                    logits,
                    tokens,
                    upstream,
                    per_token,
                    first,
                    temp,
                    (None if dtype == f32 else shifted_buf, exp_buf),
                    here,
                    None if grad_w is None else grad_w[first:last],
                    h_chunk,
                    w[first:last],
                )
            if grad_h is not None and here is not None:
                grad_h[start:end] = here
    del kept, scratch, shifted_buf, exp_buf, total
    apply: Callable[..., Any] = _PrecomputedGradients.apply
    anchor = apply(hidden, weight, grad_h, grad_w)
    shape = hidden.shape[:-1]
    return (
        log_probs.view(shape),
        None if entropy is None else entropy.view(shape),
        anchor,
    )


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
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    w = weight.detach()
    n_tokens, vocab_local = flat.shape[0], w.shape[0]
    chunk, block = _tile_for(tile, n_tokens, w)
    temp = max(float(temperature), MIN_TEMPERATURE)
    device, f32 = w.device, torch.float32
    sums = torch.empty(2, n_tokens, dtype=f32, device=device)
    row_max = torch.empty(n_tokens, dtype=f32, device=device)
    rows, columns = min(chunk, n_tokens), min(block, vocab_local)
    tile_sums = torch.empty(2, rows, dtype=f32, device=device)
    logits_buf = torch.empty(rows * columns, dtype=w.dtype, device=device)
    shifted_buf = torch.empty(rows * columns, dtype=f32, device=device)
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        h_chunk = flat[start:end].to(w.dtype)
        here = tile_sums[:, : end - start]
        for first, last in _blocks(vocab_local, block):
            logits = torch.mm(
                h_chunk, w[first:last].t(), out=work_view(logits_buf, end - start, last - first)
            )
            tile_max = logits.amax(dim=-1).to(f32)
            chunk_power_sums(logits, tile_max, temp, here, shifted_buf)
            running = (sums[:, start:end], row_max[start:end])
            _fold(running, (here, tile_max), temp, _rebase_power_sums, (0, 1), first == 0)
    _combine_over_ranks(sums, row_max, temp, group, _rebase_power_sums)
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


def _add_tile(
    logits: torch.Tensor,
    targets: torch.Tensor,
    first: int,
    temp: float,
    running: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    shifted_buf: torch.Tensor,
    exp_buf: torch.Tensor | None,
) -> None:
    """Add a tile's logits ``[C, B]`` (vocabulary rows from ``first``; ``targets`` the chunk's
    local target ids) to its token chunk's running statistics ``running = (stats, row_max,
    scratch)``: ``stats`` rows ``S``, target logit (and ``W``), relative to ``row_max``, both
    written in place; ``scratch`` a float32 ``[rows of stats, >= C]`` work array. The first
    tile (``first == 0``) starts them; later ones are combined by rescaling to the larger
    maximum (online softmax)."""
    chunk_stats, chunk_max, here = running
    with_entropy = chunk_stats.shape[0] == 3
    col, outside = target_columns(targets, first, logits.shape[1])
    chunk_stats[1] += logits.gather(1, col[:, None]).squeeze(1).masked_fill_(outside, 0)
    tile_max = logits.amax(dim=-1).to(torch.float32)
    chunk_statistics(
        logits, tile_max, temp, here[0], here[2] if with_entropy else None, shifted_buf, exp_buf
    )
    rows = (0, 2) if with_entropy else (0,)
    _fold((chunk_stats, chunk_max), (here, tile_max), temp, _rebase, rows, first == 0)


def _tile_gradient(
    logits: torch.Tensor,
    tokens: slice,
    upstream: UpstreamGradients,
    per_token: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    first: int,
    temp: float,
    buffers: tuple[torch.Tensor | None, torch.Tensor | None],
    total: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    h_chunk: torch.Tensor,
    w_block: torch.Tensor,
) -> None:
    """Turn a tile's logits ``[C, B]`` (tokens ``tokens`` of the per-token arrays
    ``per_token = (row_max, -log_sum, local targets)``, vocabulary rows from ``first``) into
    their gradient in place, then add ``dlogits @ w_block`` to ``total`` (float32 ``[C,
    hidden]``) and ``dlogits^T h_chunk`` to ``grad_weight`` (the tile's rows of W's gradient);
    ``buffers``: ``chunk_gradient``'s float32 work and probability buffers."""
    row_max, neg_log_sum, local_targets = per_token
    col, outside = target_columns(local_targets[tokens], first, logits.shape[1])
    one_hot = upstream.target_grad[tokens].masked_fill(outside[:, None], 0)
    chunk_gradient(
        logits, tokens, upstream, row_max, neg_log_sum, col[:, None], one_hot, temp, logits,
        *buffers,
    )  # fmt: skip
    if total is not None:
        if logits.dtype == torch.float32:
            total.addmm_(logits, w_block)
        else:
            total.add_(torch.mm(logits, w_block))
    if grad_weight is not None:
        grad_weight.addmm_(logits.t(), h_chunk)


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
        n_tokens, vocab_local = flat.shape[0], weight.shape[0]
        device, f32 = weight.device, torch.float32
        chunk, block = tile
        local_targets = targets.reshape(-1) - vocab_start
        # stats rows: S, target logit x_t (0 where no tile here holds it), W
        rows_of_stats = 3 if compute_entropy else 2
        stats = torch.zeros(rows_of_stats, n_tokens, dtype=f32, device=device)
        row_max = torch.empty(n_tokens, dtype=f32, device=device)
        tile_stats = torch.empty(rows_of_stats, min(chunk, n_tokens), dtype=f32, device=device)

        rows, columns = min(chunk, n_tokens), min(block, vocab_local)
        logits_buf = torch.empty(rows * columns, dtype=weight.dtype, device=device)
        shifted_buf = torch.empty(rows * columns, dtype=f32, device=device)
        exp_buf = torch.empty_like(shifted_buf) if compute_entropy else None
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            h_chunk = flat[start:end].to(weight.dtype)
            chunk_stats, chunk_max = stats[:, start:end], row_max[start:end]
            here = tile_stats[:, : end - start]
            for first, last in _blocks(vocab_local, block):
                logits = torch.mm(
                    h_chunk,
                    weight[first:last].t(),
                    out=work_view(logits_buf, end - start, last - first),
                )
                _add_tile(
                    logits,
                    local_targets[start:end],
                    first,
                    temp,
                    (chunk_stats, chunk_max, here),
                    shifted_buf,
                    exp_buf,
                )
        del logits_buf, shifted_buf, exp_buf, tile_stats
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
        temp: float = ctx.temp
        chunk, block = ctx.tile
        f32 = torch.float32
        flat = hidden.reshape(-1, hidden.shape[-1])
        n_tokens, vocab_local = flat.shape[0], weight.shape[0]
        device, dtype = weight.device, weight.dtype
        _, elsewhere = target_columns(local_targets, 0, vocab_local)
        upstream = UpstreamGradients(grads, rest[0] if rest else None, elsewhere, temp)
        neg_log_sum = -log_sum

        grad_hidden = torch.empty_like(flat) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        rows, columns = min(chunk, n_tokens), min(block, vocab_local)
        hidden_total = (
            torch.empty(rows, flat.shape[1], dtype=f32, device=device) if want_hidden else None
        )
        # the logits' buffer receives their gradient in place; float32 work space beside it
        # where the weight is not float32, and for the probabilities when the entropy has one
        logits_buf = torch.empty(rows * columns, dtype=dtype, device=device)
        work_buf = None if dtype == f32 else torch.empty(rows * columns, dtype=f32, device=device)
        prob_buf = None if upstream.slope is None else torch.empty_like(logits_buf, dtype=f32)
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            tokens = slice(start, end)
            h_chunk = flat[tokens].to(dtype)
            total = None if hidden_total is None else hidden_total[: end - start].zero_()
            for first, last in _blocks(vocab_local, block):
                w_block = weight[first:last]
                logits = torch.mm(
                    h_chunk, w_block.t(), out=work_view(logits_buf, end - start, last - first)
                )
                _tile_gradient(
                    logits,
                    tokens,
                    upstream,
                    (row_max, neg_log_sum, local_targets),
                    first,
                    temp,
                    (work_buf, prob_buf),
                    total,
                    None if grad_weight is None else grad_weight[first:last],
                    h_chunk,
                    w_block,
                )
            if grad_hidden is not None and total is not None:
                grad_hidden[tokens] = total
        grad_h = None if grad_hidden is None else grad_hidden.view(hidden.shape)
        return (grad_h, grad_weight, *no_grads)
