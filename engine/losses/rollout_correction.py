"""Rollout correction: importance weights ``pi_old / pi_rollout`` for the policy loss.

The rollout engine (vLLM, SGLang, bf16) samples from a policy ``pi_rollout`` that is not quite
the trainer's ``pi_old`` although the weights are the same; the policy loss's ratio only
corrects ``pi_theta / pi_old``. The weights ``w = pi_old / pi_rollout`` (from the batch's
``old_log_probs`` and ``rollout_log_probs``, no gradient) correct the rest: truncated importance
sampling caps them, masked importance sampling drops the tokens (or sequences) whose weight
falls outside bounds. The weighted per-token policy loss is then aggregated as usual. Semantics
follow verl's ``rollout_corr_helper`` (``rollout_is`` token / sequence, TIS cap, IcePop bounds);
the differences are listed on :class:`RolloutCorrection`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from engine.losses.aggregation import masked_mean
from engine.losses.kl import MAX_LOG_RATIO
from heads.errors import ConfigError
from heads.validation import finite, of_type, one_of, positive

ROLLOUT_LOG_PROBS = "rollout_log_probs"
#: Importance weights computed elsewhere (verl's trainer), applied as they are.
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
#: Where a weight is computed: per token, per sequence (product of its token ratios) or per
#: sequence as the geometric mean of its token ratios (length-normalised).
LEVELS = ("token", "sequence", "geometric")
#: What happens to a weight out of bounds: capped at ``upper``, or the token dropped (weight 0).
MODES = ("truncate", "mask")


def _positive_number(default: float | None) -> Any:
    validators = [of_type((int, float)), finite, positive]
    if default is None:
        return attrs.field(default=None, validator=attrs.validators.optional(validators))
    return attrs.field(default=default, validator=validators)


@attrs.frozen(kw_only=True)
class RolloutCorrection:
    """Importance weights ``w = pi_old / pi_rollout`` multiplying the per-token policy loss.

    ``level``: ``token`` (``w_t = exp(old_t - rollout_t)``), ``sequence`` (one weight per
    sequence, ``exp(sum_t (old_t - rollout_t))`` over the loss mask's tokens) or ``geometric``
    (``exp(mean_t (old_t - rollout_t))``). The log-weight is clamped to ``[-20, 20]``.
    ``mode``: ``truncate`` (TIS: ``min(w, upper)``) or ``mask`` (``w`` where
    ``lower <= w <= upper``, else 0: the token, or the whole sequence at sequence levels, drops
    out of the policy loss but still counts in the aggregation's denominator).

    Where this differs from verl: the bounds of ``mask`` default ``lower`` to ``1 / upper``
    (verl's IcePop needs both given); ``geometric`` can truncate or mask (verl has it only as a
    rejection criterion, ``seq_mean_k1``, which bounds the inverse ratio); dropping is by weight
    0, never by editing ``response_mask`` (verl's ``rollout_rs`` does that, shrinking token-mean
    denominators and the entropy / KL terms; here the global counts stay split-invariant); there
    is no batch normalisation of the weights and no k2 / k3 rejection criteria.
    """

    level: str = attrs.field(default="token", validator=one_of(*LEVELS))
    mode: str = attrs.field(default="truncate", validator=one_of(*MODES))
    #: ``truncate``: the cap; ``mask``: the largest weight kept (verl's default threshold: 2).
    upper: float = _positive_number(2.0)
    #: ``mask`` only: the smallest weight kept; None: ``1 / upper``.
    lower: float | None = _positive_number(None)

    def __attrs_post_init__(self) -> None:
        if self.lower is None:
            if self.mode == "mask" and self.upper < 1.0:
                raise ConfigError(
                    f"RolloutCorrection(mode='mask', upper={self.upper!r}) keeps weights in "
                    f"[lower, upper], and lower defaults to 1 / upper = {1 / self.upper:g}, "
                    "above upper: every token would be dropped. Give lower (<= upper), or an "
                    "upper >= 1"
                )
            return
        if self.mode != "mask":
            raise ConfigError(
                f"RolloutCorrection.lower applies to mode='mask' only (truncation caps at "
                f"upper); got lower={self.lower!r} with mode={self.mode!r}"
            )
        if self.lower > self.upper:
            raise ConfigError(
                f"RolloutCorrection.lower ({self.lower!r}) must be <= upper ({self.upper!r})"
            )

    @property
    def lower_bound(self) -> float:
        """The smallest weight ``mask`` keeps."""
        return 1.0 / self.upper if self.lower is None else self.lower


@attrs.frozen(kw_only=True)
class RolloutWeights:
    """Per-token weights (0 outside the mask and where dropped), where a masked-in token was
    dropped, and the per-token log-ratio ``old - rollout`` (0 outside the mask)."""

    weights: torch.Tensor
    dropped: torch.Tensor
    log_ratio: torch.Tensor


def rollout_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    correction: RolloutCorrection,
    *,
    dtype: torch.dtype = torch.float32,
) -> RolloutWeights:
    """The weights of ``correction`` for ``[b, s]`` log-probs, computed without gradient in the
    widest of ``dtype`` and the inputs' dtypes; masked-out positions (NaN there included) never
    reach them."""
    active = mask.bool()
    for given in (old_log_probs.dtype, rollout_log_probs.dtype):
        dtype = torch.promote_types(dtype, given)
    old = old_log_probs.detach().to(dtype)
    rollout = rollout_log_probs.detach().to(dtype)
    log_ratio = torch.where(active, old - rollout, old.new_zeros((), dtype=dtype))
    if correction.level == "token":
        log_weight = log_ratio
    else:
        log_weight = log_ratio.sum(-1, keepdim=True)
        if correction.level == "geometric":
            log_weight = log_weight / active.sum(-1, keepdim=True).clamp(min=1)
        log_weight = log_weight.expand_as(log_ratio)
    raw = torch.exp(torch.clamp(log_weight, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    if correction.mode == "truncate":
        weights = torch.clamp(raw, max=correction.upper)
        dropped = torch.zeros_like(active)
    else:
        kept = (raw >= correction.lower_bound) & (raw <= correction.upper)
        weights = torch.where(kept, raw, raw.new_zeros(()))
        dropped = active & ~kept
    zero = weights.new_zeros((), dtype=dtype)
    return RolloutWeights(
        weights=torch.where(active, weights, zero), dropped=dropped, log_ratio=log_ratio
    )


def rollout_metrics(weights: RolloutWeights, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """This micro-batch's ``rollout_is_mean`` / ``rollout_is_max`` (of the applied weights over
    the masked-in tokens), ``rollout_is_dropped`` (share of those tokens dropped),
    ``rollout_is_seq_dropped`` (share of sequences with a token dropped) and ``rollout_old_kl``
    / ``rollout_old_k3_kl``: KL(pi_rollout || pi_old) estimated on the rollout's samples, by
    ``mean(rollout - old)`` and by k3 ``mean(w - log w - 1)``, ``w`` the token ratio."""
    active = mask.bool()
    applied = weights.weights
    log_ratio = weights.log_ratio
    token_ratio = torch.exp(torch.clamp(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    has_tokens = active.any(-1)
    sequences = has_tokens.sum()
    dropped_sequences = (weights.dropped.any(-1) & has_tokens).sum()
    return {
        "rollout_is_mean": masked_mean(applied, mask),
        # the weights are >= 0, so a masked-out 0 never wins and no masked-in token gives 0
        "rollout_is_max": torch.where(active, applied, applied.new_zeros(())).max(),
        "rollout_is_dropped": masked_mean(weights.dropped.to(applied.dtype), mask),
        "rollout_is_seq_dropped": dropped_sequences / sequences.clamp(min=1),
        "rollout_old_kl": masked_mean(-log_ratio, mask),
        "rollout_old_k3_kl": masked_mean(token_ratio - log_ratio - 1.0, mask),
    }
