"""Policy losses per token, selected by name in :class:`~engine.losses.ActorLoss`.

A policy loss is ``fn(log_probs, old_log_probs, advantages, mask, clip) -> PolicyTerms``: the
per-token loss (aggregated by the caller) and which tokens the clip acted on. Every tensor is
``[b, s]`` with masked-out positions already zeroed; a loss that pools over a sequence (GSPO,
GMPO) pools over its row's masked-in tokens only, so it does not depend on the micro-batch
split. A loss with options is an attrs class (``SAPO(tau_pos=...)``), built from
``ActorLoss.policy_options``; a plain function takes none. A loss with dual clipping of its own
declares its bound with :func:`dual_clip_by_default` (``vanilla``: 3.0), one aggregated per
sequence by default declares it with :func:`aggregated_by_default`. A loss whose per-token value
depends on that token's log-prob only is declared
:func:`~engine.losses.contract.token_separable`, and so is an ``ActorLoss`` using it.

The names and formulas are verl's (``verl/trainer/ppo/core_algos.py``); where they differ (the
project's conventions, statistics taken per micro-batch) docs/rl.md says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs
import torch

from engine.losses.aggregation import masked_mean
from engine.losses.contract import token_separable
from engine.losses.kl import MAX_LOG_RATIO
from heads.errors import ConfigError
from heads.validation import finite, float_field, of_type, one_of, positive


class ClipRange(Protocol):
    """The clip settings a policy loss reads (``ActorLoss`` has them)."""

    @property
    def clip_ratio_low(self) -> float: ...

    @property
    def clip_ratio_high(self) -> float: ...

    @property
    def clip_ratio_c(self) -> float | None: ...


@attrs.frozen(kw_only=True)
class PolicyTerms:
    """A policy loss's per-token values and where its clips acted (for the clip fractions);
    ``ppo_kl``: the per-token values whose masked mean is the ``ppo_kl`` metric (None: the
    log-ratio ``old - new`` clamped to [-20, 20], as ``vanilla`` reports it)."""

    per_token: torch.Tensor
    clipped: torch.Tensor
    clipped_lower: torch.Tensor
    ppo_kl: torch.Tensor | None = None


class PolicyLoss(Protocol):
    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip: ClipRange,
    ) -> PolicyTerms: ...


F = TypeVar("F", bound=Callable[..., Any])


def dual_clip_by_default(clip_ratio_c: float) -> Callable[[F], F]:
    """Declare the dual-clip bound ``ActorLoss`` gives this policy loss when ``clip_ratio_c``
    is not set (a loss without it gets None: dual clipping is PPO's, not every loss's)."""

    def declare(policy_loss: F) -> F:
        policy_loss.default_clip_ratio_c = clip_ratio_c  # type: ignore[attr-defined]
        return policy_loss

    return declare


def default_clip_ratio_c(policy_loss: object) -> float | None:
    """The dual-clip bound ``policy_loss`` declares (:func:`dual_clip_by_default`), else None."""
    value: float | None = getattr(policy_loss, "default_clip_ratio_c", None)
    return value


def aggregated_by_default(loss_agg_mode: str) -> Callable[[F], F]:
    """Declare the ``loss_agg_mode`` ``ActorLoss`` uses with this policy loss when none is
    given (``token-mean`` otherwise): GMPO and SAPO are per-sequence objectives."""

    def declare(policy_loss: F) -> F:
        policy_loss.default_loss_agg_mode = loss_agg_mode  # type: ignore[attr-defined]
        return policy_loss

    return declare


def default_loss_agg_mode(policy_loss: object) -> str:
    """The aggregation ``policy_loss`` declares (:func:`aggregated_by_default`), else token-mean."""
    value: str = getattr(policy_loss, "default_loss_agg_mode", "token-mean")
    return value


@token_separable
@dual_clip_by_default(3.0)
def vanilla(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipRange,
) -> PolicyTerms:
    """PPO's clipped surrogate on the token ratio ``r = exp(logp - logp_old)``:
    ``max(-A r, -A clip(r, 1 - low, 1 + high))``, and ``min(that, -A c)`` for ``A < 0`` when
    ``clip_ratio_c`` is set (dual clip)."""
    return _clipped_surrogate(_exp(log_probs - old_log_probs), advantages, clip)


def gspo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipRange,
) -> PolicyTerms:
    """GSPO (Zheng et al. 2025): PPO's clipped surrogate on the sequence ratio
    ``s_i = exp(mean_t (logp - logp_old))`` (mean over the row's masked-in tokens), applied to
    every token as ``s_it = sg[s_i] exp(logp_t - sg[logp_t])``: the value ``s_i`` and the
    gradient ``s_i grad logp_t``, so the clip acts per sequence. The paper clips tightly
    (``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4``) and aggregates ``seq-mean-token-mean``;
    it has no dual clip, so none applies unless ``clip_ratio_c`` is set explicitly.
    """
    sequence_log_ratio = _sequence_mean(log_probs - old_log_probs, mask)
    token_log_ratio = sequence_log_ratio.detach() + log_probs - log_probs.detach()
    terms = _clipped_surrogate(_exp(token_log_ratio), advantages, clip)
    return attrs.evolve(terms, ppo_kl=old_log_probs - log_probs)  # verl's: unclamped


@token_separable
def cispo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipRange,
) -> PolicyTerms:
    """CISPO (MiniMax-M1, 2025): ``-sg[clip(r, 1 - low, 1 + high)] A logp``: REINFORCE weighted
    by the clipped importance ratio, so a clipped token still gets a gradient (unlike PPO's).
    ``clip_ratio_c`` does not apply (the weight is bounded already)."""
    ratio = _exp(log_probs - old_log_probs).detach()
    weight = torch.clamp(ratio, 1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high)
    return PolicyTerms(
        per_token=-weight * advantages * log_probs,
        clipped=weight != ratio,
        clipped_lower=torch.zeros_like(ratio, dtype=torch.bool),
    )


@token_separable
@aggregated_by_default("seq-mean-token-mean")
@attrs.frozen(kw_only=True)
class SAPO:
    """SAPO (Soft Adaptive Policy Optimization, 2025): a smooth gate instead of the clip,
    ``-f(r) A`` with ``f(r) = sigmoid(tau (r - 1)) 4 / tau``, ``tau = tau_pos`` where ``A > 0``
    and ``tau_neg`` elsewhere (verl's defaults 1.0 and 1.05); aggregated per sequence
    (``seq-mean-token-mean``) unless ``loss_agg_mode`` is given (verl always does so)."""

    tau_pos: float = float_field(1.0, positive)
    tau_neg: float = float_field(1.05, positive)

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip: ClipRange,
    ) -> PolicyTerms:
        tau = torch.where(
            advantages > 0,
            torch.as_tensor(self.tau_pos, dtype=advantages.dtype),
            torch.as_tensor(self.tau_neg, dtype=advantages.dtype),
        )
        gate = torch.sigmoid(tau * (_exp(log_probs - old_log_probs) - 1.0)) * (4.0 / tau)
        return PolicyTerms(per_token=-gate * advantages, **_never(mask))


@token_separable
def gpg(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipRange,
) -> PolicyTerms:
    """GPG (Group Policy Gradient, 2025): plain REINFORCE, ``-A logp`` (no ratio, no clip)."""
    return PolicyTerms(per_token=-advantages * log_probs, **_never(mask))


@attrs.frozen(kw_only=True)
class ClipCov:
    """Clip-Cov (Cui et al. 2025, the entropy mechanism of RL): PPO's clipped surrogate (no
    dual clip), with the gradient cut (loss 0) on a random ``clip_cov_ratio`` share of the
    micro-batch's tokens among those whose covariance ``(A - mean A) (logp - mean logp)`` lies
    in ``(clip_cov_lb, clip_cov_ub)`` and that the clip left alone. The means, the share and
    the draw (torch's global generator, as verl) are the micro-batch's: so the loss depends on
    the micro-batch split, as verl's does."""

    clip_cov_ratio: float = float_field(0.0002, positive)
    clip_cov_lb: float = float_field(1.0, finite)
    clip_cov_ub: float = float_field(5.0, finite)

    def __attrs_post_init__(self) -> None:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ConfigError(
                f"ClipCov.clip_cov_lb ({self.clip_cov_lb}) must be < clip_cov_ub "
                f"({self.clip_cov_ub})"
            )

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip: ClipRange,
    ) -> PolicyTerms:
        active = mask.bool()
        ratio = torch.exp(log_probs - old_log_probs)
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(
            ratio, 1 - clip.clip_ratio_low, 1 + clip.clip_ratio_high
        )
        by_clip = (clipped > unclipped) & active
        covariance = _covariance(advantages, log_probs.detach(), mask)
        candidates = (
            active & ~by_clip & (covariance < self.clip_cov_ub) & (covariance > self.clip_cov_lb)
        )
        found = torch.nonzero(candidates)
        chosen = max(int(self.clip_cov_ratio * int(active.sum())), 1)
        picked = found[torch.randperm(len(found))[:chosen]] if len(found) else found
        cut = torch.zeros_like(active)
        cut[picked[:, 0], picked[:, 1]] = True
        per_token = torch.where(cut, 0.0, torch.maximum(unclipped, clipped))
        return PolicyTerms(
            per_token=per_token,
            clipped=cut,
            clipped_lower=torch.zeros_like(cut),
            ppo_kl=old_log_probs - log_probs,
        )


@attrs.frozen(kw_only=True)
class KLCov:
    """KL-Cov (Cui et al. 2025): the unclipped surrogate ``-A r``, plus ``ppo_kl_coef |logp -
    logp_old|`` on the ``kl_cov_ratio`` share of the micro-batch's tokens of largest covariance
    ``(A - mean A) (logp - mean logp)`` (at least one). Those statistics are the
    micro-batch's, as verl's; the ``ppo_kl`` metric is the mean absolute log-ratio, as verl
    reports it."""

    kl_cov_ratio: float = float_field(0.0002, positive)
    ppo_kl_coef: float = float_field(0.1)

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip: ClipRange,
    ) -> PolicyTerms:
        active = mask.bool()
        log_ratio = log_probs - old_log_probs
        surrogate = -advantages * torch.exp(log_ratio)
        penalised = torch.zeros_like(active)
        valid_advantages, valid_log_probs = advantages[active], log_probs.detach()[active]
        if len(valid_advantages):  # the covariance over the valid tokens, taken as verl takes it
            covariance = (valid_advantages - valid_advantages.mean()) * (
                valid_log_probs - valid_log_probs.mean()
            )
            largest = max(1, int(len(covariance) * self.kl_cov_ratio))
            flat = torch.topk(covariance, largest, largest=True).indices
            penalised[tuple(index[flat] for index in torch.nonzero(active, as_tuple=True))] = True
        per_token = surrogate + torch.where(penalised, self.ppo_kl_coef * log_ratio.abs(), 0.0)
        return PolicyTerms(per_token=per_token, **_never(mask), ppo_kl=log_ratio.abs())


@aggregated_by_default("seq-mean-token-mean")
def geo_mean(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipRange,
) -> PolicyTerms:
    """GMPO (Geometric-Mean Policy Optimization, 2025): per sequence ``-A_i exp(mean_t
    clip_t(log r_t))``, ``A_i`` the mean of its advantages and each log-ratio clipped to
    ``[-clip_ratio_low, clip_ratio_high]`` against the sign of the advantage (the wider of the
    clipped and unclipped objectives is cut, per token); its value on every token of the
    sequence, aggregated per sequence (``seq-mean-token-mean``) unless ``loss_agg_mode`` is
    given (verl always takes the mean over sequences)."""
    log_ratio = log_probs - old_log_probs
    sign = torch.sign(advantages)
    bounded = torch.clamp(log_ratio, -clip.clip_ratio_low, clip.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    ratio = torch.exp(_sequence_mean(pessimistic, mask))
    sequence_loss = -_sequence_mean(advantages, mask) * ratio
    clipped = (log_ratio != bounded) & mask.bool()
    return PolicyTerms(
        per_token=sequence_loss.expand_as(log_probs),
        clipped=clipped & (advantages > 0),
        clipped_lower=clipped & (advantages < 0),
        ppo_kl=-log_ratio,
    )


@token_separable
@attrs.frozen(kw_only=True)
class DRO:
    """DRO (Direct Reward Optimization with a quadratic log-ratio penalty): ``-(A logp -
    dro_beta / 2 (logp - logp_old)^2)``. ``dro_beta`` has no default (verl requires it)."""

    dro_beta: float = attrs.field(validator=[of_type((int, float)), finite, positive])

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip: ClipRange,
    ) -> PolicyTerms:
        log_ratio = log_probs - old_log_probs
        per_token = -(log_probs * advantages - 0.5 * self.dro_beta * log_ratio.square())
        return PolicyTerms(per_token=per_token, **_never(mask), ppo_kl=-log_ratio)


def _dppo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip: ClipRange,
    kept: torch.Tensor,
) -> PolicyTerms:
    """DPPO's loss given where the divergence trust region holds (``kept``): ``-A sg[min(r,
    c)] logp`` there, 0 elsewhere (``c = clip_ratio_c``, a truncated importance weight)."""
    ratio = _exp(log_probs - old_log_probs)
    cap = clip.clip_ratio_c if clip.clip_ratio_c is not None else math.inf
    truncated = torch.clamp(ratio, max=cap).detach()
    kept = kept.detach()
    return PolicyTerms(
        per_token=torch.where(kept, -advantages * truncated * log_probs, 0.0),
        clipped=~kept,
        clipped_lower=kept & (ratio > cap),
    )


@token_separable
@dual_clip_by_default(3.0)
def dppo_tv(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipRange,
) -> PolicyTerms:
    """DPPO-Binary-TV (Divergence PPO, 2026): REINFORCE weighted by the truncated ratio, on the
    tokens whose probability moved less than ``clip_ratio_high`` up (``A > 0``) or
    ``clip_ratio_low`` down (otherwise); ``clip_ratio_c`` caps the ratio (3.0 by default, as
    verl's actor config gives it; its function's own default, and the paper's advice, is a
    larger 20)."""
    moved = torch.exp(log_probs) - torch.exp(old_log_probs)
    kept = torch.where(advantages > 0, moved <= clip.clip_ratio_high, moved >= -clip.clip_ratio_low)
    return _dppo(log_probs, old_log_probs, advantages, clip, kept)


@token_separable
@dual_clip_by_default(3.0)
def dppo_kl(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipRange,
) -> PolicyTerms:
    """DPPO-Binary-KL: as ``dppo_tv``, the trust region measured by the binary KL between the
    old and new probability of the token, ``p_old log(p_old / p) + (1 - p_old) log((1 -
    p_old) / (1 - p))`` (``+1e-8`` inside the second log, as verl), against
    ``clip_ratio_high`` / ``clip_ratio_low``; a move towards the advantage's side is kept."""
    prob, old_prob = torch.exp(log_probs), torch.exp(old_log_probs)
    binary_kl = old_prob * (old_log_probs - log_probs) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    kept = torch.where(
        advantages > 0,
        (binary_kl <= clip.clip_ratio_high) | (prob <= old_prob),
        (binary_kl <= clip.clip_ratio_low) | (prob >= old_prob),
    )
    return _dppo(log_probs, old_log_probs, advantages, clip, kept)


#: ``BypassMode.rollout_is``: importance weights per token, per sequence, or none.
BYPASS_LEVELS = ("token", "sequence")


def _bypass_level(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        one_of(*BYPASS_LEVELS)(instance, attribute, value)


@dual_clip_by_default(3.0)
@attrs.frozen(kw_only=True)
class BypassMode:
    """verl's ``bypass_mode``: the batch's ``old_log_probs`` are the rollout engine's (no
    old-log-prob pass). ``loss_type="ppo_clip"`` (default) is ``vanilla`` on them (its ratio
    already corrects the mismatch); ``"reinforce"`` is ``-w A logp`` with importance weights
    ``w = pi / pi_rollout`` (no gradient) per ``rollout_is`` level (``token``, ``sequence`` as
    verl's default, or None: no weights), truncated at ``rollout_is_threshold`` (TIS). verl's
    rejection sampling (``rollout_rs``), IcePop bounds and batch normalisation of the weights
    are not offered."""

    loss_type: str = attrs.field(default="ppo_clip", validator=one_of("ppo_clip", "reinforce"))
    rollout_is: str | None = attrs.field(default="sequence", validator=_bypass_level)
    rollout_is_threshold: float = float_field(2.0, positive)

    @property
    def token_separable(self) -> bool:
        """A sequence's weight pools its tokens' log-probs: only then is it not separable."""
        return self.loss_type == "ppo_clip" or self.rollout_is != "sequence"

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip: ClipRange,
    ) -> PolicyTerms:
        if self.loss_type == "ppo_clip":
            return vanilla(log_probs, old_log_probs, advantages, mask, clip)
        per_token = -advantages * log_probs
        if self.rollout_is is not None:
            log_weight = (log_probs - old_log_probs).detach()
            if self.rollout_is == "sequence":
                active = mask.bool()
                log_weight = torch.where(active, log_weight, 0.0).sum(-1, keepdim=True)
            weights = torch.clamp(_exp(log_weight), max=self.rollout_is_threshold)
            per_token = per_token * weights
        return PolicyTerms(per_token=per_token, **_never(mask), ppo_kl=old_log_probs - log_probs)


def _exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def _never(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``clipped`` / ``clipped_lower`` of a loss without a clip."""
    never = torch.zeros_like(mask, dtype=torch.bool)
    return {"clipped": never, "clipped_lower": never}


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean of ``values`` over its masked-in tokens, ``[b, 1]`` (0 for none)."""
    active = mask.bool()
    counts = active.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(active, values, 0.0).sum(-1, keepdim=True) / counts


def _covariance(
    advantages: torch.Tensor, log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per token ``(A - mean A) (logp - mean logp)``, the means over the micro-batch's
    masked-in tokens; ``-inf`` outside the mask."""
    active = mask.bool()
    centred = (advantages - masked_mean(advantages, mask)) * (
        log_probs - masked_mean(log_probs, mask)
    )
    return torch.where(active, centred, -math.inf)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip: ClipRange
) -> PolicyTerms:
    bounded = torch.clamp(ratio, 1.0 - clip.clip_ratio_low, 1.0 + clip.clip_ratio_high)
    unclipped, clipped = -advantages * ratio, -advantages * bounded
    per_token = torch.maximum(unclipped, clipped)
    clip_hit = clipped > unclipped
    if clip.clip_ratio_c is None:
        return PolicyTerms(
            per_token=per_token, clipped=clip_hit, clipped_lower=torch.zeros_like(clip_hit)
        )
    lower_bound = -advantages * clip.clip_ratio_c
    negative = advantages < 0
    return PolicyTerms(
        per_token=torch.where(negative, torch.minimum(per_token, lower_bound), per_token),
        clipped=clip_hit,
        clipped_lower=negative & (per_token > lower_bound),
    )
