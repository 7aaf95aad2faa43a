"""Per-token KL estimators of the policy from a reference policy, and the KL-penalised token
rewards (KL in the reward rather than in the loss)."""

from __future__ import annotations

import torch

from heads.errors import BatchError, ConfigError

#: Estimators a ``+`` may follow (straight-through: this value, ``k2``'s gradient).
_STRAIGHT_THROUGH_BASES = ("k1", "k2", "k3", "low_var_kl", "abs")
#: KL estimators of :func:`kl_penalty` (``low_var_kl`` is another name for ``k3``).
KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "abs", *(f"{b}+" for b in _STRAIGHT_THROUGH_BASES))

#: ``log(ratio)`` is clamped to this before ``exp`` (keeps the ratio and its gradient finite).
MAX_LOG_RATIO = 20.0
#: The k3 ("low_var_kl") estimate is clamped to ``[-MAX_K3, MAX_K3]``.
MAX_K3 = 10.0


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference policy.

    ``k1``: ``logp - logp_ref``; ``k2``: ``0.5 * (logp - logp_ref)^2``; ``k3`` / ``low_var_kl``:
    ``exp(logp_ref - logp) - (logp_ref - logp) - 1`` clamped to ``[-10, 10]`` (the log-ratio is
    clamped to ``[-20, 20]`` before ``exp``, which changes no value after the outer clamp but
    keeps ``exp`` and its gradient finite); ``abs``: ``|logp - logp_ref|``.

    ``k1+``, ``k2+``, ``k3+``, ``low_var_kl+``, ``abs+`` are straight-through: the value of the
    estimator before the ``+`` with the gradient of ``k2`` (``k2 - sg[k2] + sg[base]``): on the
    policy's own samples ``k2``'s gradient estimates the KL's gradient without bias, ``k1``'s does
    not. ``k2+`` is ``k2`` itself (accepted so that every estimator takes a ``+``, as in verl).
    """
    if kind not in KL_TYPES:
        raise ConfigError(f"kl type must be one of {', '.join(map(repr, KL_TYPES))}; got {kind!r}")
    diff = log_probs - ref_log_probs
    if kind.endswith("+"):
        k2 = 0.5 * diff.square()
        return k2 - k2.detach() + kl_penalty(log_probs, ref_log_probs, kind[:-1]).detach()
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "abs":
        return diff.abs()
    log_ratio = torch.clamp(-diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -MAX_K3, MAX_K3)


def kl_penalized_rewards(
    rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    coeff: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards - coeff * kl, kl)`` on the masked-in tokens (0 elsewhere), ``kl`` per token
    by :func:`kl_penalty` (``k1``: ``logp - logp_ref``), for advantage estimation.

    Computed without gradient: a reward is data. Float64 inputs stay float64.
    """
    if not rewards.shape == log_probs.shape == ref_log_probs.shape == mask.shape:
        raise BatchError(
            "kl_penalized_rewards needs rewards, log-probs, reference log-probs and mask of one "
            f"shape; got {tuple(rewards.shape)}, {tuple(log_probs.shape)}, "
            f"{tuple(ref_log_probs.shape)}, {tuple(mask.shape)}"
        )
    active = mask.bool()
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, log_probs.dtype), torch.float32)

    def masked(x: torch.Tensor) -> torch.Tensor:
        return torch.where(active, x.detach().to(dtype), 0.0)

    kl = masked(kl_penalty(masked(log_probs), masked(ref_log_probs), kind))
    return masked(rewards) - coeff * kl, kl
