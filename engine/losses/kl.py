"""Per-token KL estimators of the policy from a reference policy."""

from __future__ import annotations

import torch

from heads.errors import ConfigError

#: KL estimators of :func:`kl_penalty` (``low_var_kl`` is another name for ``k3``).
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")

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
    keeps ``exp`` and its gradient finite).
    """
    if kind not in KL_TYPES:
        raise ConfigError(f"kl type must be one of {', '.join(map(repr, KL_TYPES))}; got {kind!r}")
    diff = log_probs - ref_log_probs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    log_ratio = torch.clamp(-diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -MAX_K3, MAX_K3)
