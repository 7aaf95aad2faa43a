"""PPO losses: the clipped policy loss (with entropy bonus and KL penalty) and the clipped
value loss, as configurable objects, plus the entropy bonus and KL penalty alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from engine.losses.aggregation import (
    AGG_MODES,
    aggregate,
    local_context,
    masked_mean,
    select_mask,
    zero_masked,
)
from engine.losses.contract import (
    LossContext,
    LossResult,
    is_token_separable,
    needs_fields,
    needs_outputs,
    scalar_output,
    token_separable,
)
from engine.losses.kl import KL_TYPES, MAX_LOG_RATIO, kl_penalty
from engine.losses.policy import (
    BypassMode,
    PolicyLoss,
    default_clip_ratio_c,
    default_loss_agg_mode,
)
from engine.losses.registries import POLICY_LOSSES, policy_loss_field
from engine.losses.rollout_correction import (
    ROLLOUT_IS_WEIGHTS,
    ROLLOUT_LOG_PROBS,
    RolloutCorrection,
    rollout_metrics,
    rollout_weights,
)
from engine.registry import build_part
from heads.base import PER_TOKEN, Granularity
from heads.errors import BatchError, ConfigError
from heads.validation import finite, non_negative, of_type, one_of, positive


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
    validators = [of_type((int, float)), finite, *checks]
    validator = attrs.validators.optional(validators) if optional else validators
    return attrs.field(default=default, validator=validator)


def _mode_field() -> Any:
    return attrs.field(default="token-mean", validator=one_of(*AGG_MODES))


def _horizon_field() -> Any:
    return attrs.field(default=None, validator=attrs.validators.optional([of_type(int), positive]))


def _mask_key_field() -> Any:
    return attrs.field(default=None, validator=attrs.validators.optional(of_type(str)))


def _named_policy_loss(loss: Any) -> Any:
    """The registry's entry for ``loss.policy_loss`` (None for a name the validator refuses)."""
    name = loss.policy_loss
    if not isinstance(name, str) or name not in POLICY_LOSSES.names():
        return None
    return POLICY_LOSSES.get(name)


def _default_clip_ratio_c(loss: Any) -> float | None:
    """The named policy loss's dual-clip default."""
    return default_clip_ratio_c(_named_policy_loss(loss))


def _default_loss_agg_mode(loss: Any) -> str:
    """The named policy loss's aggregation default (``token-mean`` unless it declares one)."""
    return default_loss_agg_mode(_named_policy_loss(loss))


def build_policy_loss(name: str, options: Mapping[str, Any]) -> PolicyLoss:
    """The policy loss ``name`` with ``options``: an attrs class is built from them (each
    checked, an unknown one refused by name), a plain function takes none."""
    factory: Any = POLICY_LOSSES.get(name)
    if attrs.has(factory):
        built: Any = build_part(factory, options, f"policy loss {name!r}")
        policy: PolicyLoss = built
        return policy
    if options:
        raise ConfigError(
            f"ActorLoss.policy_options: policy loss {name!r} takes no options; got "
            f"{', '.join(sorted(options))}"
        )
    function: PolicyLoss = factory
    return function


def _check_horizon(instance: Any) -> None:
    if instance.loss_agg_mode == "seq-mean-token-sum-norm" and instance.horizon is None:
        raise ConfigError(
            f"{type(instance).__name__}.horizon must be set (a fixed positive token count, e.g. "
            "the maximum response length) when loss_agg_mode is 'seq-mean-token-sum-norm'"
        )


@attrs.frozen(kw_only=True)
class ActorLoss:
    """Policy loss, minus an entropy bonus, plus a KL penalty (LM head).

    The per-token policy loss ``l`` is the registered policy loss named ``policy_loss``
    (:mod:`engine.losses.policy`): ``vanilla`` is PPO's, with ``r = exp(logp - logp_old)``
    (log-ratio clamped to ``[-20, 20]``) and advantage ``A``:
    ``l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; for ``A < 0`` and
    ``clip_ratio_c`` set, ``l = min(l, -A clip_ratio_c)`` (dual clip; by default 3.0 for
    ``vanilla``, ``dppo_tv``, ``dppo_kl`` and ``bypass_mode``, off for the others); ``gspo``
    clips a sequence ratio, ``cispo`` weights log-probs by the clipped ratio, and so on (the
    table in docs/rl.md); ``policy_options`` are the chosen loss's own settings.
    The loss is ``agg(l) - entropy_coeff * agg(entropy) + kl_coeff * agg(kl)``, every ``agg``
    being :func:`aggregate` with ``loss_agg_mode`` over the mask (``mask_key``, else
    ``loss_mask``, else ``response_mask``).

    Needs batch fields ``old_log_probs``, ``advantages`` (and ``ref_log_probs`` when
    ``kl_coeff > 0``), the ``log_probs`` output and, when ``entropy_coeff > 0``, the ``entropy``
    output (LM head ``compute_entropy=True``). Metrics (local to the micro-batch): ``pg_loss``,
    ``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``, ``entropy`` (when the head outputs it),
    ``kl`` (when the batch has ``ref_log_probs``).

    With ``rollout_correction`` (:class:`~engine.losses.rollout_correction.RolloutCorrection`)
    ``l`` is multiplied by the importance weights ``pi_old / pi_rollout`` (batch field
    ``rollout_log_probs``) before aggregation, whatever the policy loss; metrics
    ``rollout_is_mean``, ``rollout_is_max``, ``rollout_is_dropped``, ``rollout_is_seq_dropped``,
    ``rollout_old_kl``, ``rollout_old_k3_kl``. Weights computed elsewhere (verl's trainer passes
    its own) come as the per-token batch field ``rollout_is_weights`` and multiply ``l`` as they
    are (metric ``rollout_is_mean``); a batch with them and a ``rollout_correction`` (or
    ``bypass_mode``, which weights by itself) is refused rather than weighted twice.
    """

    #: A name in the policy loss registry (``vanilla``, ``gspo``, ``sapo``, ... or registered).
    policy_loss: str = policy_loss_field()
    #: The policy loss's options, as verl names them (``sapo``: ``tau_pos``, ``tau_neg``;
    #: ``clip_cov``: ``clip_cov_ratio``, ...); a loss without options takes none.
    policy_options: Mapping[str, Any] = attrs.field(
        factory=dict, converter=dict, validator=of_type(dict), hash=False
    )
    clip_ratio_low: float = _number(0.2, non_negative, _below_one)
    clip_ratio_high: float = _number(0.2, non_negative)
    #: Dual-clip bound ``c > 1`` for negative advantages; None disables dual clipping. Unset:
    #: the policy loss's own default (``vanilla`` 3.0; ``gspo``, ``cispo`` and losses that
    #: declare none: None).
    clip_ratio_c: float | None = attrs.field(
        default=attrs.Factory(_default_clip_ratio_c, takes_self=True),
        validator=attrs.validators.optional([of_type((int, float)), finite, _above_one]),
    )
    #: Unset: the policy loss's own default (``seq-mean-token-mean`` for ``sapo`` and
    #: ``geo_mean``, ``token-mean`` for the others).
    loss_agg_mode: str = attrs.field(
        default=attrs.Factory(_default_loss_agg_mode, takes_self=True),
        validator=one_of(*AGG_MODES),
    )
    #: Fixed token count for ``seq-mean-token-sum-norm`` (required by that mode only).
    horizon: int | None = _horizon_field()
    entropy_coeff: float = _number(0.0, non_negative)
    kl_coeff: float = _number(0.0, non_negative)
    kl_type: str = attrs.field(default="low_var_kl", validator=one_of(*KL_TYPES))
    #: The mask field to train on; None: ``loss_mask`` if present, else ``response_mask``.
    mask_key: str | None = _mask_key_field()
    #: Importance weights ``pi_old / pi_rollout`` on the policy loss, from the batch field
    #: ``rollout_log_probs``; None: no correction.
    rollout_correction: RolloutCorrection | None = attrs.field(
        default=None, validator=attrs.validators.optional(of_type(RolloutCorrection))
    )

    #: The policy loss built from ``policy_loss`` and ``policy_options``.
    _policy: PolicyLoss = attrs.field(init=False, eq=False, repr=False, hash=False)

    def __attrs_post_init__(self) -> None:
        _check_horizon(self)
        policy = build_policy_loss(self.policy_loss, self.policy_options)
        if self.rollout_correction is not None and isinstance(policy, BypassMode):
            raise ConfigError(
                "ActorLoss.rollout_correction with policy_loss='bypass_mode': bypass mode takes "
                "the rollout's log-probs as old_log_probs and weights by its own rollout_is "
                "option; drop one"
            )
        object.__setattr__(self, "_policy", policy)

    @property
    def required_fields(self) -> dict[str, Granularity | None]:
        names = ["old_log_probs", "advantages"]
        if self.rollout_correction is not None:
            names.append(ROLLOUT_LOG_PROBS)
        if self.kl_coeff > 0:
            names.append("ref_log_probs")
        if self.mask_key is not None:
            names.append(self.mask_key)
        return dict.fromkeys(names, PER_TOKEN)

    @property
    def required_outputs(self) -> tuple[str, ...]:
        """``log_probs``, and ``entropy`` when it enters the loss (``entropy_coeff > 0``)."""
        return ("log_probs", "entropy") if self.entropy_coeff > 0 else ("log_probs",)

    @property
    def token_separable(self) -> bool:
        """Whether its policy loss is (the entropy and KL terms, the aggregation and the
        rollout weights are: they weight each token by batch-only numbers)."""
        return is_token_separable(self._policy)

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
    ) -> LossResult:
        agg = _Aggregation(batch, ctx, self.loss_agg_mode, self.horizon, self.mask_key)
        mask = agg.mask
        log_probs = zero_masked(scalar_output(outputs, "log_probs", PER_TOKEN, "ActorLoss"), mask)
        dtype = log_probs.dtype
        old = zero_masked(batch["old_log_probs"].to(dtype), mask)
        advantages = zero_masked(batch["advantages"].to(dtype), mask)

        terms = self._policy(log_probs, old, advantages, mask, self)
        per_token, rollout = self._rollout_weighted(terms.per_token, batch, mask, dtype)
        ppo_kl = terms.ppo_kl
        if ppo_kl is None:
            ppo_kl = -torch.clamp(log_probs - old, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        loss = agg.loss(per_token)
        metrics: dict[str, float | torch.Tensor] = {
            "pg_loss": agg.metric(per_token),
            "pg_clipfrac": masked_mean(terms.clipped.to(dtype), mask),
            "ppo_kl": masked_mean(ppo_kl.detach(), mask),
            "pg_clipfrac_lower": masked_mean(terms.clipped_lower.to(dtype), mask),
            **rollout,
        }

        if "entropy" in outputs:  # the entropy bonus's term
            entropy = _entropy(outputs, mask, "ActorLoss")
            metrics["entropy"] = agg.metric(entropy)
            if self.entropy_coeff > 0:
                loss = loss - self.entropy_coeff * agg.loss(entropy)
        elif self.entropy_coeff > 0:
            raise ConfigError(
                f"ActorLoss.entropy_coeff={self.entropy_coeff} needs the head's 'entropy' output; "
                "build the LM head with compute_entropy=True"
            )
        if "ref_log_probs" in batch.keys():  # the KL loss's term
            kl = _kl(log_probs, batch, mask, self.kl_type)
            metrics["kl"] = agg.metric(kl)
            if self.kl_coeff > 0:
                loss = loss + self.kl_coeff * agg.loss(kl)
        elif self.kl_coeff > 0:
            raise BatchError(
                f"ActorLoss.kl_coeff={self.kl_coeff} needs the batch field 'ref_log_probs'"
            )
        return loss, metrics

    def _rollout_weighted(
        self, per_token: torch.Tensor, batch: Any, mask: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token policy loss times the rollout weights (the batch's precomputed ones,
        or ``rollout_correction``'s), and their metrics."""
        if ROLLOUT_IS_WEIGHTS in batch.keys():  # verl's trainer hands its weights over
            if self.rollout_correction is not None or isinstance(self._policy, BypassMode):
                raise BatchError(
                    f"the batch holds precomputed {ROLLOUT_IS_WEIGHTS!r} and ActorLoss computes "
                    "its own (rollout_correction, or policy_loss='bypass_mode'): give one, not "
                    "both (they would multiply)"
                )
            weights_field = zero_masked(batch[ROLLOUT_IS_WEIGHTS].to(dtype), mask).detach()
            return per_token * weights_field, {"rollout_is_mean": masked_mean(weights_field, mask)}
        if self.rollout_correction is None:
            return per_token, {}
        # the one place every policy loss is weighted
        if ROLLOUT_LOG_PROBS not in batch.keys():
            raise BatchError(
                f"ActorLoss.rollout_correction needs the batch field {ROLLOUT_LOG_PROBS!r} "
                "(the rollout engine's log-probs of the sampled tokens)"
            )
        weights = rollout_weights(
            batch["old_log_probs"],
            batch[ROLLOUT_LOG_PROBS],
            mask,
            self.rollout_correction,
            dtype=torch.promote_types(dtype, torch.float32),
        )
        return per_token * weights.weights, rollout_metrics(weights, mask)


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

    #: The head output it reads.
    required_outputs = ("values",)

    @property
    def required_fields(self) -> dict[str, Granularity | None]:
        names = ["returns"]
        if self.cliprange_value is not None:
            names.append("values")
        if self.mask_key is not None:
            names.append(self.mask_key)
        return dict.fromkeys(names, PER_TOKEN)

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
    ) -> LossResult:
        agg = _Aggregation(batch, ctx, self.loss_agg_mode, self.horizon, self.mask_key)
        mask = agg.mask
        predictions = zero_masked(scalar_output(outputs, "values", PER_TOKEN, "CriticLoss"), mask)
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

        loss = 0.5 * agg.loss(per_token)
        metrics: dict[str, float | torch.Tensor] = {
            "vf_loss": 0.5 * agg.metric(per_token),
            "vf_clipfrac": masked_mean(clip_hit.to(dtype), mask),
            "vpred_mean": masked_mean(predictions.detach(), mask),
        }
        return loss, metrics


@token_separable
@needs_fields()
@needs_outputs("entropy")
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
    agg = _Aggregation(batch, ctx, loss_agg_mode, horizon, mask_key)
    entropy = _entropy(outputs, agg.mask, "entropy_bonus")
    return -agg.loss(entropy), {"entropy": agg.metric(entropy)}


@token_separable
@needs_fields(ref_log_probs=PER_TOKEN)
@needs_outputs("log_probs")
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
    agg = _Aggregation(batch, ctx, loss_agg_mode, horizon, mask_key)
    log_probs = zero_masked(scalar_output(outputs, "log_probs", PER_TOKEN, "kl_loss"), agg.mask)
    kl = _kl(log_probs, batch, agg.mask, kl_type)
    return agg.loss(kl), {"kl": agg.metric(kl)}


class _Aggregation:
    """A loss call's aggregation of per-token values over its mask (``mask_key``, else
    ``loss_mask``, else ``response_mask``): the loss's share of the global aggregate, and the
    metric, the same over this micro-batch alone."""

    def __init__(
        self,
        batch: Any,
        ctx: LossContext,
        loss_agg_mode: str,
        horizon: float | None,
        mask_key: str | None,
    ) -> None:
        self.mask, self.mask_key = select_mask(batch, mask_key)
        self.mode, self.horizon, self.ctx = loss_agg_mode, horizon, ctx
        self.local = local_context(ctx, self.mask, self.mask_key)

    def loss(self, values: torch.Tensor) -> torch.Tensor:
        return self._over(values, self.ctx)

    def metric(self, values: torch.Tensor) -> torch.Tensor:
        return self._over(values.detach(), self.local)

    def _over(self, values: torch.Tensor, ctx: LossContext) -> torch.Tensor:
        return aggregate(
            values, self.mask, self.mode, ctx, mask_key=self.mask_key, horizon=self.horizon
        )


def _entropy(outputs: Mapping[str, torch.Tensor], mask: torch.Tensor, loss: str) -> torch.Tensor:
    """The head's entropy output, read by ``loss``, masked."""
    return zero_masked(scalar_output(outputs, "entropy", PER_TOKEN, loss), mask)


def _kl(log_probs: torch.Tensor, batch: Any, mask: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per token, the KL penalty of the (masked) ``log_probs`` against ``ref_log_probs``."""
    ref = zero_masked(batch["ref_log_probs"].to(log_probs.dtype), mask)
    return kl_penalty(log_probs, ref, kl_type)
