"""Advantage estimators on padded ``[B, T]`` tensors aligned like the engine's outputs.

``values[:, t]`` is ``V(x_<t)``, the state in which token ``t`` (the action) was chosen, and
``rewards[:, t]`` the reward for choosing it, so an action's successor state is the next
*masked-in* position of the same row; masked-out positions (prompt, padding) are skipped and
their rewards ignored.

An estimator returns ``(advantages, returns)``, both zero at masked-out positions and in float32
or wider (float64 inputs stay float64). ``returns`` is what the advantage is measured against a
baseline of: the lambda-return ``A + V`` (GAE), the discounted reward-to-go (REINFORCE++,
ReMax), or the outcome score broadcast to the response tokens (the group estimators).

This module holds the contract and the estimators of single rows (GAE, REINFORCE++, ReMax);
those comparing the responses to one prompt are in :mod:`engine.losses.group_advantages`, the
per-timestep optimal baselines in :mod:`engine.losses.token_baselines`. An estimator that reads
more than rewards, mask, values and group ids names the batch fields in ``inputs`` (ReMax: the
greedy response's score ``reward_baselines``) and takes them as keyword arguments.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import attrs
import torch

from heads.errors import BatchError, ConfigError
from heads.validation import bool_field, float_field


def unit_interval(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value <= 1:
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name} must be in [0, 1], got {value!r}"
        )


def check_tokens(name: str, rewards: torch.Tensor, mask: torch.Tensor) -> None:
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise BatchError(
            f"{name} needs rewards and mask of one [batch, tokens] shape; got "
            f"{tuple(rewards.shape)} and {tuple(mask.shape)}"
        )


def result_dtype(*tensors: torch.Tensor) -> torch.dtype:
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


def estimator_inputs(estimator: object) -> tuple[str, ...]:
    """The batch fields ``estimator`` reads beyond rewards, mask, values and group ids, given to
    it as keyword arguments of those names (its optional ``inputs`` declaration; none if
    undeclared)."""
    declared: tuple[str, ...] = tuple(getattr(estimator, "inputs", ()))
    return declared


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each masked-in token's undiscounted reward-to-go (its reward plus every later masked-in
    one of its row), 0 elsewhere."""
    check_tokens("reward_to_go", rewards, mask)
    active = mask.bool()
    masked = torch.where(active, rewards.to(result_dtype(rewards)), 0.0)
    return torch.where(active, masked.flip(-1).cumsum(-1).flip(-1), 0.0)


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
    dtype = result_dtype(rewards, values)
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
    (others 0): ``(x - mean) / sqrt(var + eps)``, as verl's ``masked_whiten``; the variance
    floor keeps entries equal up to rounding near 0 rather than blowing the rounding up to
    O(1). A lone entry becomes 0."""
    active = mask.bool()
    values = torch.where(active, values.to(result_dtype(values)), 0.0)
    count = int(active.sum())
    if count < 2:
        return torch.where(active, values - values[active].mean() if count else values, 0.0)
    selected = values[active]
    normalised = (values - selected.mean()) * torch.rsqrt(selected.var() + eps)
    return torch.where(active, normalised, 0.0)


def outcome_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's sum of token rewards over the mask, ``[B]``."""
    check_tokens("outcome_scores", rewards, mask)
    active = mask.bool()
    return torch.where(active, rewards.to(result_dtype(rewards)), 0.0).sum(-1)


@attrs.frozen(kw_only=True)
class GAE:
    """``gae``: :func:`gae_advantages` over a critic's values, advantages whitened over the
    batch (``whiten_advantages``), as PPO trainers do."""

    needs_values: ClassVar[bool] = True
    needs_groups: ClassVar[bool] = False
    gamma: float = float_field(1.0, unit_interval)
    lam: float = float_field(0.95, unit_interval)
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
class ReinforcePlusPlus:
    """``reinforce_plus_plus``: the ``gamma``-discounted reward-to-go over each row's masked-in
    tokens, whitened over the batch's masked-in tokens (no critic, no groups)."""

    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = False
    gamma: float = float_field(1.0, unit_interval)

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_tokens("reinforce_plus_plus", rewards, mask)
        # With V = 0 and lambda = 1, GAE's advantage is the discounted reward-to-go.
        returns, _ = gae_advantages(
            rewards, torch.zeros_like(rewards), mask, gamma=self.gamma, lam=1.0
        )
        return whiten(returns, mask), returns


@attrs.frozen(kw_only=True)
class ReMax:
    """``remax`` (Li et al. 2023): the reward-to-go minus the score of the prompt's greedy
    response (``reward_baselines``, one per row), on every response token; ``returns`` the
    reward-to-go. The caller samples that greedy response and scores it."""

    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = False
    inputs: ClassVar[tuple[str, ...]] = ("reward_baselines",)

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
        reward_baselines: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        returns = reward_to_go(rewards, mask)
        if reward_baselines is None or reward_baselines.shape != rewards.shape[:1]:
            found = "none" if reward_baselines is None else f"shape {tuple(reward_baselines.shape)}"
            raise BatchError(
                "the 'remax' advantage estimator needs reward_baselines, the greedy response's "
                f"score for each row (shape ({rewards.shape[0]},)); got {found}"
            )
        baseline = reward_baselines.to(returns.dtype)[:, None]
        return torch.where(mask.bool(), returns - baseline, 0.0), returns
