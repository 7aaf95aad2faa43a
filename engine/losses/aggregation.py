"""Masks and aggregation: each micro-batch's share of a global per-token aggregate."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from engine.losses.contract import (
    LOSS_MASK,
    RESPONSE_MASK,
    SCORED_TOKENS,
    SEQUENCES,
    LossContext,
)
from heads.errors import BatchError, ConfigError

#: Aggregation modes of :func:`aggregate`.
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def scored_mask(batch: Any) -> tuple[torch.Tensor, str]:
    """The batch's ``loss_mask`` if it has one, else every token with a prediction; and the
    key of its global count."""
    if LOSS_MASK in batch.keys():
        return batch[LOSS_MASK].float(), LOSS_MASK
    mask = batch["attention_mask"].float().clone()
    mask[:, 0] = 0.0
    return mask, SCORED_TOKENS


def select_mask(batch: Any, mask_key: str | None = None) -> tuple[torch.Tensor, str]:
    """The mask an RL loss uses and the key of its global count: ``batch[mask_key]`` if given,
    else ``loss_mask``, else ``response_mask`` (no fallback to every token: a policy or value
    loss over the prompt is a silent error)."""
    keys = batch.keys()
    candidates = (mask_key,) if mask_key is not None else (LOSS_MASK, RESPONSE_MASK)
    for key in candidates:
        if key in keys:
            mask: torch.Tensor = batch[key]
            return mask, key
    names = ", ".join(str(name) for name in keys)
    raise BatchError(
        f"this loss needs a per-token {' or '.join(map(repr, candidates))} field marking the "
        f"tokens to train on; the batch has: {names}"
    )


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` with the masked-out positions set to 0 by ``torch.where``: NaN/inf there reach
    neither the result nor (as NaN) the gradient. Apply it to the inputs of a per-token
    computation *before* any nonlinearity (``0 * exp(nan)`` is NaN in backward)."""
    # a zero made on the values' device: a host-made one would be copied over at every call
    return torch.where(mask.bool(), values, values.new_zeros(()))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Local (this tensor only) mask-weighted mean; 0 when the mask is all zero."""
    weights = zero_masked(mask.to(_compute_dtype(values)), mask)
    total = (zero_masked(values.to(weights.dtype), mask) * weights).sum()
    count = weights.sum()
    return total / torch.where(count > 0, count, torch.ones_like(count))


def token_mean(
    values: torch.Tensor, mask: torch.Tensor, count: float | torch.Tensor
) -> torch.Tensor:
    """This micro-batch's share of the global token mean; masked-out NaN/inf never leak in."""
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    if isinstance(count, torch.Tensor):
        return (masked * mask).sum() / count.clamp(min=1.0)
    return (masked * mask).sum() / max(count, 1.0)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    ctx: LossContext,
    *,
    mask_key: str | None = None,
    horizon: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the global aggregate of per-token ``values`` ``[b, s]``.

    With ``m`` the mask (used as weights; usually 0/1), ``x`` the values, ``i`` a sequence of
    this micro-batch and ``t`` a token, summed over the micro-batch:

    * ``token-mean``: ``sum_it m x / G[mask_key]`` (``G`` = ``ctx.global_count``; the global
      mask sum, so the micro-batch shares add up to the global token mean).
    * ``token-sum``: ``sum_it m x`` (shares add up to the global sum).
    * ``seq-mean-token-sum``: ``sum_i (sum_t m x) / G['sequences']``.
    * ``seq-mean-token-mean``: ``sum_i (sum_t m x / sum_t m) / G['sequences']``; a sequence
      with an all-zero mask contributes 0 (and still counts as a sequence).
    * ``seq-mean-token-sum-norm``: ``sum_i (sum_t m x / horizon) / G['sequences']``, with a
      fixed ``horizon`` (e.g. the maximum response length; never the padded width, which
      depends on the split).

    Masked-out positions are removed with ``torch.where``, so NaN/inf there never reach the
    result or the gradient; an all-zero mask gives 0. Global counts of 0 are treated as 1.
    """
    if mode not in AGG_MODES:
        raise ConfigError(
            f"aggregation mode must be one of {', '.join(map(repr, AGG_MODES))}; got {mode!r}"
        )
    if values.shape != mask.shape or values.dim() != 2:
        raise BatchError(
            f"aggregate needs per-token values and mask of one shape [b, s]; got values "
            f"{list(values.shape)} and mask {list(mask.shape)}"
        )
    weights = zero_masked(mask.to(_compute_dtype(values)), mask)
    per_token = zero_masked(values.to(weights.dtype), mask) * weights
    if mode == "token-mean":
        if mask_key is None:
            raise ConfigError(
                "aggregate(mode='token-mean') needs mask_key: the name of the mask's global "
                f"count (one of: {', '.join(ctx.global_counts)})"
            )
        return per_token.sum() / _denominator(ctx.global_count(mask_key))
    if mode == "token-sum":
        return per_token.sum()
    sequences = _denominator(ctx.global_count(SEQUENCES))
    if mode == "seq-mean-token-sum":
        return per_token.sum() / sequences
    if mode == "seq-mean-token-mean":
        counts = weights.sum(-1)
        has_tokens = counts > 0
        per_sequence = per_token.sum(-1) / torch.where(has_tokens, counts, torch.ones_like(counts))
        return zero_masked(per_sequence, has_tokens).sum() / sequences
    if horizon is None or not (isinstance(horizon, (int, float)) and 0 < horizon < math.inf):
        raise ConfigError(
            f"aggregation mode 'seq-mean-token-sum-norm' needs horizon, a fixed positive token "
            f"count (e.g. the maximum response length); got {horizon!r}"
        )
    return per_token.sum() / (float(horizon) * sequences)


def local_context(ctx: LossContext, mask: torch.Tensor, mask_key: str) -> LossContext:
    """A context whose global counts are this micro-batch's own (for local metrics); the mask's
    sum stays on the device (reading it would wait for the device)."""
    counts: dict[str, float | torch.Tensor] = {
        SEQUENCES: float(mask.shape[0]),
        mask_key: mask.float().sum(),
    }
    return attrs.evolve(ctx, global_counts=counts)


def _compute_dtype(values: torch.Tensor) -> torch.dtype:
    """At least float32 (sums of bf16/fp16 per-token values lose too much)."""
    return torch.promote_types(values.dtype, torch.float32)


def _denominator(count: float | torch.Tensor) -> float | torch.Tensor:
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, count, torch.ones_like(count))
    return count if count > 0 else 1.0
