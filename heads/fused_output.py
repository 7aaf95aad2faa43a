"""Per-token log-probabilities and entropy straight from the final hidden states and the
(vocab-parallel) output weight: the output layer fused with ``heads.vocab_parallel``'s math, so
that the ``[tokens, vocab]`` logits never exist for the whole micro-batch.

Forward walks the tokens in chunks: ``logits = h_chunk @ W_local^T`` (a matmul in the weight's
dtype, as the unfused output layer computes it), then the chunk's per-token statistics in
float32 with ``vocab_parallel``'s own chunk code (row max, ``sum exp``, target logit, entropy
term). The statistics of each chunk are relative to its *local* row max; after the loop the
ranks of a tensor-parallel group agree on the global max (one all-reduce MAX), rescale their
sums to it and add them up (one all-reduce SUM): the same two collectives as ``vocab_parallel``.
Only ``O(tokens)`` numbers are kept, besides ``h`` and ``W`` themselves.

Backward recomputes each chunk's logits, turns them into their gradient with
``vocab_parallel.chunk_gradient`` (in place), and accumulates ``grad_h`` (per chunk) and
``grad_W`` (summed over chunks in the weight's dtype: each chunk's matmul accumulates in float32,
but a low-precision weight's gradient is rounded once per chunk, not once as the unfused
layer's; Liger's fused linear cross-entropy does the same). One more matmul than the unfused
path (the recomputation): 4 instead of 3.

Under tensor parallelism ``grad_h`` is this rank's part (its vocabulary columns): the hidden
states are the input of a column-parallel layer, and the caller sums their gradient over the
group as that layer does (megatron's ``copy_to_tensor_model_parallel_region``, or the
sequence-parallel gather). Upstream gradients must be identical on every rank of the group (the
loss is computed redundantly), as for ``vocab_parallel``.

Memory (``C`` tokens per chunk, ``V`` local vocabulary): forward, one ``[C, V]`` buffer in the
weight's dtype and one or two float32 ones; backward, the same plus the gradients of ``h`` and
``W``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from heads.vocab_parallel import (
    DEFAULT_CHUNK_ELEMENTS,
    DEFAULT_CPU_CHUNK_ELEMENTS,
    MIN_TEMPERATURE,
    UpstreamGradients,
    all_reduce_over,
    chunk_gradient,
    chunk_statistics,
    finish_statistics,
    target_columns,
)

__all__ = ["MIN_CHUNK_TOKENS", "default_chunk_tokens", "fused_log_probs_and_entropy"]

MIN_CHUNK_TOKENS = 128
"""The fewest tokens a default chunk holds: the chunk's matmul ``[C, hidden] x [hidden, V]``
keeps a full tile of rows for the accelerator's matrix units."""

_CHUNKS_PER_BATCH = 16
"""A default chunk holds at most 1/16 of the micro-batch's tokens (but ``MIN_CHUNK_TOKENS``):
the work buffers stay a small fraction of what the whole logits would take."""


def default_chunk_tokens(n_tokens: int, vocab_local: int, device: torch.device) -> int:
    """Tokens per chunk: about ``DEFAULT_CHUNK_ELEMENTS`` logits (``DEFAULT_CPU_CHUNK_ELEMENTS``
    on CPU) and at most 1/16 of the tokens, but never fewer than ``MIN_CHUNK_TOKENS``."""
    budget = DEFAULT_CPU_CHUNK_ELEMENTS if device.type == "cpu" else DEFAULT_CHUNK_ELEMENTS
    return max(MIN_CHUNK_TOKENS, min(budget // vocab_local, n_tokens // _CHUNKS_PER_BATCH))


def fused_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    chunk_size: int | None = None,
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
        chunk_size: tokens per chunk; None: :func:`default_chunk_tokens`.

    Returns:
        ``(log_probs, entropy)``, float32 ``[...]`` (entropy None when not computed); the
        log-probs are bit-identical with and without the entropy. Differentiable w.r.t.
        ``hidden`` (this rank's part under ``group``, see the module doc) and ``weight``.
    """
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
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] "
            f"{tuple(hidden.shape[:-1])}"
        )
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64, got {targets.dtype}")
    if group is None and vocab_start != 0:
        raise ValueError("vocab_start must be 0 when group is None (full vocabulary)")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if chunk_size is None:
        chunk_size = default_chunk_tokens(targets.numel(), weight.shape[0], weight.device)
    temp = max(float(temperature), MIN_TEMPERATURE)
    apply: Callable[..., Any] = _FusedLogProbsAndEntropy.apply
    outputs = apply(hidden, weight, targets, temp, compute_entropy, group, vocab_start, chunk_size)
    if compute_entropy:
        log_probs, entropy = outputs
        return log_probs, entropy
    return outputs, None


class _FusedLogProbsAndEntropy(torch.autograd.Function):
    """Saves ``hidden``, ``weight`` (no copies) and per-token ``max``, ``log(sum exp)``, entropy.

    Chunk statistics relative to the chunk's own row max ``m`` (``s = (x - m) / T``,
    ``S = sum exp(s)``, ``W = sum exp(s) s``) move to another max ``M >= m`` with
    ``d = (M - m) / T``: ``S' = exp(-d) S`` and ``W' = exp(-d) (W - d S)``.
    """

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
        chunk: int,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        flat = hidden.reshape(-1, hidden.shape[-1])
        n_tokens, vocab_local = flat.shape[0], weight.shape[0]
        device, f32 = weight.device, torch.float32
        idx, elsewhere = target_columns(targets.reshape(-1), vocab_start, vocab_local)
        row_max = torch.empty(n_tokens, dtype=f32, device=device)
        # stats rows: S, target logit x_t (0 when another rank holds it), W
        stats = torch.empty(3 if compute_entropy else 2, n_tokens, dtype=f32, device=device)

        rows = min(chunk, n_tokens)
        logits_buf = torch.empty(rows, vocab_local, dtype=weight.dtype, device=device)
        shifted_buf = torch.empty(rows, vocab_local, dtype=f32, device=device)
        exp_buf = torch.empty_like(shifted_buf) if compute_entropy else None
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            logits = torch.mm(
                flat[start:end].to(weight.dtype), weight.t(), out=logits_buf[: end - start]
            )
            row_max[start:end] = logits.amax(dim=-1)
            stats[1, start:end] = logits.gather(1, idx[start:end, None]).squeeze(1)
            chunk_statistics(
                logits,
                row_max[start:end],
                temp,
                stats[0, start:end],
                stats[2, start:end] if compute_entropy else None,
                shifted_buf,
                exp_buf,
            )
        del logits_buf, shifted_buf, exp_buf
        stats[1].masked_fill_(elsewhere, 0)
        if group is not None:  # every rank's sums relative to the global max, then added up
            local_max = row_max.clone()
            all_reduce_over(row_max, dist.ReduceOp.MAX, group)
            shift = (row_max - local_max).div_(temp)
            scale = torch.exp(-shift)
            if compute_entropy:
                stats[2].sub_(shift * stats[0]).mul_(scale)
            stats[0].mul_(scale)
            all_reduce_over(stats, dist.ReduceOp.SUM, group)
        log_probs, log_sum, entropy = finish_statistics(stats, row_max, temp)

        saved = [hidden, weight, idx, elsewhere, row_max, log_sum]
        if entropy is not None:
            saved.append(entropy)
        ctx.save_for_backward(*saved)
        ctx.temp = temp
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)
        shape = hidden.shape[:-1]
        if entropy is None:
            return log_probs.view(shape)
        return log_probs.view(shape), entropy.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, idx, elsewhere, row_max, log_sum, *rest = ctx.saved_tensors
        no_grads = (None,) * 6
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        if all(g is None for g in grads) or not (want_hidden or want_weight):
            return (None, None, *no_grads)
        temp: float = ctx.temp
        chunk: int = ctx.chunk
        f32 = torch.float32
        flat = hidden.reshape(-1, hidden.shape[-1])
        n_tokens, vocab_local = flat.shape[0], weight.shape[0]
        device, dtype = weight.device, weight.dtype
        upstream = UpstreamGradients(grads, rest[0] if rest else None, elsewhere, temp)
        neg_log_sum = -log_sum

        grad_hidden = torch.empty_like(flat) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        rows = min(chunk, n_tokens)
        buf_shape = (rows, vocab_local)
        # the logits' buffer receives their gradient in place; float32 work space beside it
        # where the weight is not float32, and for the probabilities when the entropy has one
        logits_buf = torch.empty(buf_shape, dtype=dtype, device=device)
        work_buf = None if dtype == f32 else torch.empty(buf_shape, dtype=f32, device=device)
        prob_buf = (
            None if upstream.slope is None else torch.empty(buf_shape, dtype=f32, device=device)
        )
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            h_chunk = flat[start:end].to(dtype)
            logits = torch.mm(h_chunk, weight.t(), out=logits_buf[: end - start])
            chunk_gradient(
                logits,
                slice(start, end),
                upstream,
                row_max,
                neg_log_sum,
                idx,
                temp,
                logits,
                work_buf,
                prob_buf,
            )
            if grad_hidden is not None:
                grad_hidden[start:end] = torch.mm(logits, weight)
            if grad_weight is not None:
                grad_weight.addmm_(logits.t(), h_chunk)
        grad_h = None if grad_hidden is None else grad_hidden.view(hidden.shape)
        return (grad_h, grad_weight, *no_grads)
