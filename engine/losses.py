"""Loss functions: ``loss_fn(outputs, batch, ctx) -> (loss, metrics)``.

``outputs`` are the head's per-token results and ``batch`` the micro-batch's fields, both
right-padded ``[b, s]``; ``ctx`` tells the micro-batch's place in the global batch. A loss is
normalised by *global* counts (``ctx.global_count``), so the micro-batch losses add up to the
batch loss and the gradient does not depend on how the batch was split or on the
data-parallel size (gradients are summed over micro-batches and data-parallel ranks).

Metrics are this micro-batch's *local* statistics (floats); the engine averages them over
micro-batches. Only the returned loss is the micro-batch's share of the global value.

Building blocks: :func:`aggregate` (the aggregation modes of :data:`AGG_MODES`),
:func:`kl_penalty` (per-token KL estimators), :func:`zero_masked`, :func:`masked_mean`.
Loss functions: :func:`sft_loss`, :func:`value_regression_loss`, :func:`policy_loss`,
:func:`value_loss`, :func:`entropy_bonus`, :func:`kl_loss`, and the configurable
:class:`ActorLoss` (PPO + entropy bonus + KL penalty) and :class:`CriticLoss` objects. Configure
the functions with ``functools.partial``; any callable with the same signature works too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from heads.errors import BatchError, ConfigError
from heads.validation import non_negative, of_type, one_of, positive

LOSS_MASK = "loss_mask"
RESPONSE_MASK = "response_mask"
#: Count key for the tokens that have a prediction (every token but each sequence's first).
SCORED_TOKENS = "scored_tokens"
SEQUENCES = "sequences"

#: Aggregation modes of :func:`aggregate`.
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
#: KL estimators of :func:`kl_penalty` (``low_var_kl`` is another name for ``k3``).
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")

#: ``log(ratio)`` is clamped to this before ``exp`` (keeps the ratio and its gradient finite).
_MAX_LOG_RATIO = 20.0
#: The k3 ("low_var_kl") estimate is clamped to ``[-_MAX_K3, _MAX_K3]``.
_MAX_K3 = 10.0

LossResult = tuple[torch.Tensor, dict[str, float]]


@attrs.frozen(kw_only=True)
class LossContext:
    """Where a micro-batch sits in the global batch."""

    micro_batch_index: int
    num_micro_batches: int
    data_parallel_size: int
    #: Global (all data-parallel ranks) sums: ``scored_tokens``, ``sequences`` and every
    #: per-token field whose name ends in ``mask``.
    global_counts: Mapping[str, float]

    def global_count(self, key: str) -> float:
        try:
            return self.global_counts[key]
        except KeyError:
            raise BatchError(
                f"no global count for {key!r}; the batch provides: {', '.join(self.global_counts)}"
            ) from None


# -- masks and aggregation -----------------------------------------------------------------------
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
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Local (this tensor only) mask-weighted mean; 0 when the mask is all zero."""
    weights = zero_masked(mask.to(_compute_dtype(values)), mask)
    total = (zero_masked(values.to(weights.dtype), mask) * weights).sum()
    count = weights.sum()
    return total / torch.where(count > 0, count, torch.ones_like(count))


def token_mean(values: torch.Tensor, mask: torch.Tensor, count: float) -> torch.Tensor:
    """This micro-batch's share of the global token mean; masked-out NaN/inf never leak in."""
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
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
    """A context whose global counts are this micro-batch's own (for local metrics)."""
    counts = {SEQUENCES: float(mask.shape[0]), mask_key: float(mask.float().sum())}
    return attrs.evolve(ctx, global_counts=counts)


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference policy.

    ``k1``: ``logp - logp_ref``; ``k2``: ``0.5 * (logp - logp_ref)^2``; ``k3`` / ``low_var_kl``:
    ``exp(logp_ref - logp) - (logp_ref - logp) - 1`` clamped to ``[-10, 10]`` (the log-ratio is
    clamped to ``[-20, 20]`` before ``exp``, which changes no value after the outer clamp but
    keeps ``exp`` and its gradient finite).
    """
    if kind not in KL_TYPES:
        raise ConfigError(f"kl type must be one of {', '.join(map(repr, KL_TYPES))}; got {kind!r}")
    diff = log_probs - ref_log_probs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    log_ratio = torch.clamp(-diff, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -_MAX_K3, _MAX_K3)


# -- validators for the loss objects --------------------------------------------------------------
def _finite(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name} must be a finite number, got {value!r}"
        )


def _below_one(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value >= 1:
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name} must be < 1 (the lower clip bound is "
            f"1 - {attribute.name}), got {value!r}"
        )


def _above_one(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 1:
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name} must be > 1 (dual-clip bound) or None "
            f"to disable dual clipping, got {value!r}"
        )


def _number(default: float | None, *checks: Any, optional: bool = False) -> Any:
    validators = [of_type((int, float)), _finite, *checks]
    validator = attrs.validators.optional(validators) if optional else validators
    return attrs.field(default=default, validator=validator)


def _mode_field() -> Any:
    return attrs.field(default="token-mean", validator=one_of(*AGG_MODES))


def _horizon_field() -> Any:
    return attrs.field(default=None, validator=attrs.validators.optional([of_type(int), positive]))


def _mask_key_field() -> Any:
    return attrs.field(default=None, validator=attrs.validators.optional(of_type(str)))


def _check_horizon(instance: Any) -> None:
    if instance.loss_agg_mode == "seq-mean-token-sum-norm" and instance.horizon is None:
        raise ConfigError(
            f"{type(instance).__name__}.horizon must be set (a fixed positive token count, e.g. "
            "the maximum response length) when loss_agg_mode is 'seq-mean-token-sum-norm'"
        )


# -- RL losses -------------------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class ActorLoss:
    """PPO clipped policy loss, minus an entropy bonus, plus a KL penalty (LM head).

    Per token, with ``r = exp(logp - logp_old)`` (log-ratio clamped to ``[-20, 20]``) and
    advantage ``A``: ``l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``;
    for ``A < 0`` and ``clip_ratio_c`` set, ``l = min(l, -A clip_ratio_c)`` (dual clip).
    The loss is ``agg(l) - entropy_coeff * agg(entropy) + kl_coeff * agg(kl)``, every ``agg``
    being :func:`aggregate` with ``loss_agg_mode`` over the mask (``mask_key``, else
    ``loss_mask``, else ``response_mask``).

    Needs batch fields ``old_log_probs``, ``advantages`` (and ``ref_log_probs`` when
    ``kl_coeff > 0``), the ``log_probs`` output and, when ``entropy_coeff > 0``, the ``entropy``
    output (LM head ``compute_entropy=True``). Metrics (local to the micro-batch): ``pg_loss``,
    ``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``, ``entropy`` (when the head outputs it),
    ``kl`` (when the batch has ``ref_log_probs``).
    """

    clip_ratio_low: float = _number(0.2, non_negative, _below_one)
    clip_ratio_high: float = _number(0.2, non_negative)
    #: Dual-clip bound ``c > 1`` for negative advantages; None disables dual clipping.
    clip_ratio_c: float | None = _number(3.0, _above_one, optional=True)
    loss_agg_mode: str = _mode_field()
    #: Fixed token count for ``seq-mean-token-sum-norm`` (required by that mode only).
    horizon: int | None = _horizon_field()
    entropy_coeff: float = _number(0.0, non_negative)
    kl_coeff: float = _number(0.0, non_negative)
    kl_type: str = attrs.field(default="low_var_kl", validator=one_of(*KL_TYPES))
    #: The mask field to train on; None: ``loss_mask`` if present, else ``response_mask``.
    mask_key: str | None = _mask_key_field()

    def __attrs_post_init__(self) -> None:
        _check_horizon(self)

    @property
    def required_fields(self) -> tuple[str, ...]:
        names = ["old_log_probs", "advantages"]
        if self.kl_coeff > 0:
            names.append("ref_log_probs")
        if self.mask_key is not None:
            names.append(self.mask_key)
        return tuple(names)

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
    ) -> LossResult:
        mask, key = select_mask(batch, self.mask_key)
        local = local_context(ctx, mask, key)

        def agg(values: torch.Tensor, context: LossContext) -> torch.Tensor:
            return aggregate(
                values, mask, self.loss_agg_mode, context, mask_key=key, horizon=self.horizon
            )

        log_probs = zero_masked(outputs["log_probs"], mask)
        dtype = log_probs.dtype
        old = zero_masked(batch["old_log_probs"].to(dtype), mask)
        advantages = zero_masked(batch["advantages"].to(dtype), mask)

        log_ratio = torch.clamp(log_probs - old, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(
            ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high
        )
        per_token = torch.maximum(unclipped, clipped)
        clip_hit = clipped > unclipped
        if self.clip_ratio_c is not None:
            lower_bound = -advantages * self.clip_ratio_c
            negative = advantages < 0
            lower_hit = negative & (per_token > lower_bound)
            per_token = torch.where(negative, torch.minimum(per_token, lower_bound), per_token)
        else:
            lower_hit = torch.zeros_like(clip_hit)

        loss = agg(per_token, ctx)
        metrics = {
            "pg_loss": float(agg(per_token.detach(), local)),
            "pg_clipfrac": float(masked_mean(clip_hit.to(dtype), mask)),
            "ppo_kl": float(masked_mean(-log_ratio.detach(), mask)),
            "pg_clipfrac_lower": float(masked_mean(lower_hit.to(dtype), mask)),
        }

        entropy = outputs.get("entropy")
        if self.entropy_coeff > 0 and entropy is None:
            raise ConfigError(
                f"ActorLoss.entropy_coeff={self.entropy_coeff} needs the head's 'entropy' output; "
                "build the LM head with compute_entropy=True"
            )
        if entropy is not None:
            entropy = zero_masked(entropy, mask)
            metrics["entropy"] = float(agg(entropy.detach(), local))
            if self.entropy_coeff > 0:
                loss = loss - self.entropy_coeff * agg(entropy, ctx)

        if "ref_log_probs" in batch.keys():
            ref = zero_masked(batch["ref_log_probs"].to(dtype), mask)
            kl = kl_penalty(log_probs, ref, self.kl_type)
            metrics["kl"] = float(agg(kl.detach(), local))
            if self.kl_coeff > 0:
                loss = loss + self.kl_coeff * agg(kl, ctx)
        elif self.kl_coeff > 0:
            raise BatchError(
                f"ActorLoss.kl_coeff={self.kl_coeff} needs the batch field 'ref_log_probs'"
            )
        return loss, metrics


@attrs.frozen(kw_only=True)
class CriticLoss:
    """Clipped value loss (value head): with predictions ``v``, old values ``v_old`` (batch field
    ``values``) and returns ``R``, ``0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) -
    R)^2))`` with ``c = cliprange_value``; ``cliprange_value=None`` gives the unclipped
    ``0.5 * agg((v - R)^2)`` (and then ``values`` is not needed). Metrics (local): ``vf_loss``,
    ``vf_clipfrac``, ``vpred_mean``.
    """

    cliprange_value: float | None = _number(0.5, positive, optional=True)
    loss_agg_mode: str = _mode_field()
    horizon: int | None = _horizon_field()
    mask_key: str | None = _mask_key_field()

    def __attrs_post_init__(self) -> None:
        _check_horizon(self)

    @property
    def required_fields(self) -> tuple[str, ...]:
        names = ["returns"]
        if self.cliprange_value is not None:
            names.append("values")
        if self.mask_key is not None:
            names.append(self.mask_key)
        return tuple(names)

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
    ) -> LossResult:
        mask, key = select_mask(batch, self.mask_key)
        predictions = zero_masked(outputs["values"], mask)
        dtype = predictions.dtype
        returns = zero_masked(batch["returns"].to(dtype), mask)
        per_token = (predictions - returns).square()
        clip_hit = torch.zeros_like(per_token, dtype=torch.bool)
        if self.cliprange_value is not None:
            old = zero_masked(batch["values"].to(dtype), mask)
            clipped_prediction = torch.clamp(
                predictions, old - self.cliprange_value, old + self.cliprange_value
            )
            clipped = (clipped_prediction - returns).square()
            clip_hit = clipped > per_token
            per_token = torch.maximum(per_token, clipped)

        def agg(values: torch.Tensor, context: LossContext) -> torch.Tensor:
            return aggregate(
                values, mask, self.loss_agg_mode, context, mask_key=key, horizon=self.horizon
            )

        loss = 0.5 * agg(per_token, ctx)
        metrics = {
            "vf_loss": float(0.5 * agg(per_token.detach(), local_context(ctx, mask, key))),
            "vf_clipfrac": float(masked_mean(clip_hit.to(dtype), mask)),
            "vpred_mean": float(masked_mean(predictions.detach(), mask)),
        }
        return loss, metrics


def policy_loss(
    outputs: Mapping[str, torch.Tensor],
    batch: Any,
    ctx: LossContext,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    horizon: int | None = None,
    mask_key: str | None = None,
) -> LossResult:
    """PPO clipped policy loss alone (:class:`ActorLoss` without entropy bonus or KL penalty;
    the options are validated the same way)."""
    return ActorLoss(
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        horizon=horizon,
        mask_key=mask_key,
    )(outputs, batch, ctx)


policy_loss.required_fields = ("old_log_probs", "advantages")  # type: ignore[attr-defined]


def value_loss(
    outputs: Mapping[str, torch.Tensor],
    batch: Any,
    ctx: LossContext,
    *,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    horizon: int | None = None,
    mask_key: str | None = None,
) -> LossResult:
    """Clipped value loss (:class:`CriticLoss`; the options are validated the same way)."""
    return CriticLoss(
        cliprange_value=cliprange_value,
        loss_agg_mode=loss_agg_mode,
        horizon=horizon,
        mask_key=mask_key,
    )(outputs, batch, ctx)


value_loss.required_fields = ("values", "returns")  # type: ignore[attr-defined]


def entropy_bonus(
    outputs: Mapping[str, torch.Tensor],
    batch: Any,
    ctx: LossContext,
    *,
    loss_agg_mode: str = "token-mean",
    horizon: float | None = None,
    mask_key: str | None = None,
) -> LossResult:
    """``-agg(entropy)`` (add ``coeff`` times it to a loss to reward entropy); metric
    ``entropy`` (local). Needs the LM head's ``entropy`` output."""
    if "entropy" not in outputs:
        raise ConfigError("entropy_bonus needs the head's 'entropy' output (compute_entropy=True)")
    mask, key = select_mask(batch, mask_key)
    entropy = zero_masked(outputs["entropy"], mask)
    loss = -aggregate(entropy, mask, loss_agg_mode, ctx, mask_key=key, horizon=horizon)
    local = aggregate(
        entropy.detach(),
        mask,
        loss_agg_mode,
        local_context(ctx, mask, key),
        mask_key=key,
        horizon=horizon,
    )
    return loss, {"entropy": float(local)}


entropy_bonus.required_fields = ()  # type: ignore[attr-defined]


def kl_loss(
    outputs: Mapping[str, torch.Tensor],
    batch: Any,
    ctx: LossContext,
    *,
    kl_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    horizon: float | None = None,
    mask_key: str | None = None,
) -> LossResult:
    """``agg(kl_penalty(log_probs, ref_log_probs, kl_type))``; metric ``kl`` (local)."""
    mask, key = select_mask(batch, mask_key)
    log_probs = zero_masked(outputs["log_probs"], mask)
    ref = zero_masked(batch["ref_log_probs"].to(log_probs.dtype), mask)
    kl = kl_penalty(log_probs, ref, kl_type)
    loss = aggregate(kl, mask, loss_agg_mode, ctx, mask_key=key, horizon=horizon)
    local = aggregate(
        kl.detach(),
        mask,
        loss_agg_mode,
        local_context(ctx, mask, key),
        mask_key=key,
        horizon=horizon,
    )
    return loss, {"kl": float(local)}


kl_loss.required_fields = ("ref_log_probs",)  # type: ignore[attr-defined]


# -- simple losses ---------------------------------------------------------------------------------
def sft_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the masked tokens, global token mean (LM head)."""
    mask, key = scored_mask(batch)
    loss = -token_mean(outputs["log_probs"], mask, ctx.global_count(key))
    return loss, {"sft_loss": float(loss.detach())}


sft_loss.required_fields = ()  # type: ignore[attr-defined]


def value_regression_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * (values - returns)^2``, global token mean over the masked tokens (value head)."""
    mask, key = scored_mask(batch)
    values = outputs["values"]
    loss = 0.5 * token_mean(
        (values - batch["returns"].to(values.dtype)) ** 2, mask, ctx.global_count(key)
    )
    vpred = token_mean(values.detach(), mask, float(mask.sum()))
    return loss, {"vf_loss": float(loss.detach()), "vpred_mean": float(vpred)}


value_regression_loss.required_fields = ("returns",)  # type: ignore[attr-defined]


def required_fields(loss_fn: Any) -> tuple[str, ...]:
    """Batch fields ``loss_fn`` declares it needs (``required_fields`` attribute, if any)."""
    while hasattr(loss_fn, "func") and not hasattr(loss_fn, "required_fields"):
        loss_fn = loss_fn.func  # functools.partial
    return tuple(getattr(loss_fn, "required_fields", ()))


# -- internals -------------------------------------------------------------------------------------
def _compute_dtype(values: torch.Tensor) -> torch.dtype:
    """At least float32 (sums of bf16/fp16 per-token values lose too much)."""
    return torch.promote_types(values.dtype, torch.float32)


def _denominator(count: float) -> float:
    return count if count > 0 else 1.0
