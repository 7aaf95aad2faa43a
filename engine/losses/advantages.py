"""Advantage estimators on padded ``[B, T]`` tensors aligned like the engine's outputs.

``values[:, t]`` is ``V(x_<t)``, the state in which token ``t`` (the action) was chosen, and
``rewards[:, t]`` the reward for choosing it, so an action's successor state is the next
*masked-in* position of the same row; masked-out positions (prompt, padding) are skipped and
their rewards ignored.

An estimator returns ``(advantages, returns)``, both zero at masked-out positions and in float32
or wider (float64 inputs stay float64). ``returns`` is what the advantage is measured against a
baseline of: the lambda-return ``A + V`` (GAE), the discounted reward-to-go (REINFORCE++), or
the outcome score broadcast to the response tokens (the group estimators).

The group estimators compare responses to the same prompt: ``group_ids[i]`` (a ``[B]`` integer
tensor, any labels, any order) names row ``i``'s group. A row's outcome score is the sum of its
token rewards over the mask. Rows with no masked-in token are not responses: their advantages
are 0 and they are left out of their group's statistics. A group with one response, or whose
responses all scored the same, carries no signal: its advantages are exactly 0.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import attrs
import torch

from heads.errors import BatchError, ConfigError
from heads.validation import bool_field, float_field, positive


def _unit_interval(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value <= 1:
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name} must be in [0, 1], got {value!r}"
        )


def _check_tokens(name: str, rewards: torch.Tensor, mask: torch.Tensor) -> None:
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise BatchError(
            f"{name} needs rewards and mask of one [batch, tokens] shape; got "
            f"{tuple(rewards.shape)} and {tuple(mask.shape)}"
        )


def _result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The inputs' common floating dtype, at least float32 (float64 stays float64)."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


class AdvantageEstimator(Protocol):
    """What the registry's advantage estimators are: options in the object, tensors in the call."""

    @property
    def needs_values(self) -> bool:
        """Whether it reads a critic's ``values`` (callers build no critic otherwise)."""

    @property
    def needs_groups(self) -> bool:
        """Whether it reads ``group_ids`` (callers sample several responses per prompt)."""

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: ``(advantages, returns)``, zero where ``mask`` is 0.

    ``delta_t = r_t + gamma V_next - V_t`` and ``A_t = delta_t + gamma lam A_next``, where
    "next" is the following action of the row (``V = 0`` after the last); ``returns = A + V``.
    """
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise BatchError(
            "gae_advantages needs rewards, values and mask of one [batch, tokens] shape; got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    active = mask.bool()
    dtype = _result_dtype(rewards, values)
    rewards, values = rewards.to(dtype), values.to(dtype)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        here = active[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(here, delta + gamma * lam * running, running)
        next_value = torch.where(here, values[:, t], next_value)
        advantages[:, t] = torch.where(here, running, 0.0)
    returns = torch.where(active, advantages + values, 0.0)
    return advantages, returns


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Shift and scale the masked-in entries to mean 0 and (unbiased) standard deviation 1
    (others 0); a lone entry becomes 0."""
    active = mask.bool()
    values = torch.where(active, values.to(_result_dtype(values)), 0.0)
    count = int(active.sum())
    if count < 2:
        return torch.where(active, values - values[active].mean() if count else values, 0.0)
    selected = values[active]
    normalised = (values - selected.mean()) / (selected.std() + eps)
    return torch.where(active, normalised, 0.0)


def outcome_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's sum of token rewards over the mask, ``[B]``."""
    _check_tokens("outcome_scores", rewards, mask)
    active = mask.bool()
    return torch.where(active, rewards.to(_result_dtype(rewards)), 0.0).sum(-1)


@attrs.frozen(kw_only=True)
class GAE:
    """``gae``: :func:`gae_advantages` over a critic's values, advantages whitened over the
    batch (``whiten_advantages``), as PPO trainers do."""

    needs_values: ClassVar[bool] = True
    needs_groups: ClassVar[bool] = False
    gamma: float = float_field(1.0, _unit_interval)
    lam: float = float_field(0.95, _unit_interval)
    whiten_advantages: bool = bool_field(True)

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if values is None:
            raise BatchError("the 'gae' advantage estimator needs the critic's values")
        advantages, returns = gae_advantages(rewards, values, mask, gamma=self.gamma, lam=self.lam)
        if self.whiten_advantages:
            advantages = whiten(advantages, mask)
        return advantages, returns


@attrs.frozen(kw_only=True)
class GRPO:
    """``grpo``: ``(score - group mean) / (group std + eps)`` with the unbiased std, for every
    response token; ``scale_by_std=False`` gives ``score - group mean`` (Dr. GRPO)."""

    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = True
    eps: float = float_field(1e-6, positive)
    scale_by_std: bool = bool_field(True)

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = _GroupStatistics.of("grpo", rewards, mask, group_ids)
        centred = groups.scores - groups.mean
        if self.scale_by_std:
            centred = centred / (groups.std + self.eps)
        return groups.advantages(centred, mask), groups.per_token(groups.scores, mask)


@attrs.frozen(kw_only=True)
class RLOO:
    """``rloo``: ``score - mean of the other responses' scores`` (leave-one-out baseline)."""

    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = True

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = _GroupStatistics.of("rloo", rewards, mask, group_ids)
        others = (groups.total - groups.scores) / (groups.count - 1).clamp(min=1)
        return (
            groups.advantages(groups.scores - others, mask),
            groups.per_token(groups.scores, mask),
        )


@attrs.frozen(kw_only=True)
class ReinforcePlusPlus:
    """``reinforce_plus_plus``: the ``gamma``-discounted reward-to-go over each row's masked-in
    tokens, whitened over the batch's masked-in tokens (no critic, no groups)."""

    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = False
    gamma: float = float_field(1.0, _unit_interval)

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_tokens("reinforce_plus_plus", rewards, mask)
        # With V = 0 and lambda = 1, GAE's advantage is the discounted reward-to-go.
        returns, _ = gae_advantages(
            rewards, torch.zeros_like(rewards), mask, gamma=self.gamma, lam=1.0
        )
        return whiten(returns, mask), returns


@attrs.frozen(kw_only=True)
class ReinforcePlusPlusBaseline:
    """``reinforce_plus_plus_baseline``: ``score - group mean`` on every response token, then
    whitened over the batch's masked-in tokens."""

    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = True

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = _GroupStatistics.of("reinforce_plus_plus_baseline", rewards, mask, group_ids)
        centred = groups.advantages(groups.scores - groups.mean, mask)
        return whiten(centred, mask), groups.per_token(groups.scores, mask)


@attrs.frozen(kw_only=True)
class _GroupStatistics:
    """Per row: its outcome score and its group's count, total, mean and unbiased std, over the
    group's rows that have masked-in tokens."""

    scores: torch.Tensor
    count: torch.Tensor
    total: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    #: Rows whose advantage is 0 by definition: no tokens, alone, or all scores equal.
    silent: torch.Tensor

    @classmethod
    def of(
        cls, name: str, rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None
    ) -> _GroupStatistics:
        _check_tokens(name, rewards, mask)
        if group_ids is None or group_ids.shape != rewards.shape[:1]:
            found = "none" if group_ids is None else f"shape {tuple(group_ids.shape)}"
            raise BatchError(
                f"the {name!r} advantage estimator needs group_ids, one group label per row "
                f"(shape ({rewards.shape[0]},)); got {found}"
            )
        scores = outcome_scores(rewards, mask)
        responds = mask.bool().any(-1)
        _, row_group = torch.unique(group_ids, return_inverse=True)
        row_group = row_group.to(scores.device)
        groups = int(row_group.max()) + 1 if row_group.numel() else 0

        def per_group_sum(x: torch.Tensor) -> torch.Tensor:
            summed = torch.zeros(groups, dtype=x.dtype, device=x.device)
            return summed.index_add(0, row_group, torch.where(responds, x, 0.0))[row_group]

        def per_group(x: torch.Tensor, reduce: str, fill: float) -> torch.Tensor:
            start = torch.full((groups,), fill, dtype=x.dtype, device=x.device)
            picked = torch.where(responds, x, fill)
            return start.scatter_reduce(0, row_group, picked, reduce)[row_group]

        count = per_group_sum(torch.ones_like(scores))
        total = per_group_sum(scores)
        mean = total / count.clamp(min=1)
        variance = per_group_sum((scores - mean).square()) / (count - 1).clamp(min=1)
        spread = per_group(scores, "amax", -torch.inf) - per_group(scores, "amin", torch.inf)
        silent = ~responds | (count < 2) | (spread == 0)
        return cls(
            scores=scores, count=count, total=total, mean=mean, std=variance.sqrt(), silent=silent
        )

    def advantages(self, per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``per_row`` advantages, 0 on silent rows, on every masked-in token of their row."""
        return self.per_token(torch.where(self.silent, 0.0, per_row), mask)

    def per_token(self, per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``per_row`` on every masked-in token of its row (0 elsewhere)."""
        return torch.where(mask.bool(), per_row[:, None], 0.0)
