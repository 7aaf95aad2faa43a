"""Policy losses per token, selected by name in :class:`~engine.losses.ActorLoss`.

A policy loss is ``fn(log_probs, old_log_probs, advantages, mask, clip) -> PolicyTerms``: the
per-token loss (aggregated by the caller) and which tokens the clip acted on. Every tensor is
``[b, s]`` with masked-out positions already zeroed; a loss that pools over a sequence (GSPO)
pools over its row's masked-in tokens only, so it does not depend on the micro-batch split.
A loss with dual clipping of its own declares its bound with :func:`dual_clip_by_default`
(``vanilla``: 3.0); the others get ``clip_ratio_c=None`` unless the user sets one. A loss
whose per-token value depends on that token's log-prob only (``vanilla``, ``cispo``; not
``gspo``) is declared :func:`~engine.losses.contract.token_separable`, and so is an
``ActorLoss`` using it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs
import torch

from engine.losses.contract import token_separable
from engine.losses.kl import MAX_LOG_RATIO


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
    """A policy loss's per-token values and where its clips acted (for the clip fractions)."""

    per_token: torch.Tensor
    clipped: torch.Tensor
    clipped_lower: torch.Tensor


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
    active = mask.bool()
    counts = active.sum(-1, keepdim=True).clamp(min=1)
    sequence_log_ratio = torch.where(active, log_probs - old_log_probs, 0.0).sum(-1, keepdim=True)
    token_log_ratio = (sequence_log_ratio / counts).detach() + log_probs - log_probs.detach()
    return _clipped_surrogate(_exp(token_log_ratio), advantages, clip)


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


def _exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


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
