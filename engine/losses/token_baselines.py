"""Optimal token baselines (verl's ``optimal_token_baseline``, ``tir_optimal_token_baseline``):
a baseline per timestep of a prompt's responses, weighted by each path's accumulated variance.

For a response, ``G_t`` is the reward-to-go at its ``t``-th step and ``W_t = sum_{j<=t} w_j``
its cumulative path-variance proxy, ``w_j = 1 - 2 pi_j + sum_v pi_v^2`` (``pi_j`` the sampled
token's probability under the policy that sampled it, ``old_log_probs``; ``sum_v pi_v^2`` the
LM head's ``sum_pi_squared`` output), times ``rho_j^2`` when rollout importance weights are
given. Over the group's responses, ``B_t = sum G_t W_t / (sum W_t + epsilon)`` and the advantage
is ``G_t - B_t``. With ``handle_zero_tail`` the baseline is 0 past the second-longest response
on the one longest (no other response saw those steps). A response alone in its group keeps
``G_t`` (no baseline). Steps are counted from the response's first token (its first masked-in
position): every position from there for ``optimal_token_baseline``, masked-in tokens only for
``tir_optimal_token_baseline`` (multi-turn: tool outputs between turns are not steps).
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from engine.losses.advantages import check_tokens, result_dtype, reward_to_go
from engine.losses.group_advantages import GroupStatistics
from heads.errors import BatchError
from heads.validation import bool_field, float_field, positive

#: The batch fields these estimators read beside the rewards (``rollout_is_weights`` optional).
INPUTS = ("old_log_probs", "sum_pi_squared")


@attrs.frozen(kw_only=True)
class OptimalTokenBaseline:
    """``optimal_token_baseline``: steps are positions from the response's first token."""

    name: ClassVar[str] = "optimal_token_baseline"
    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = True
    #: Required keyword inputs; ``rollout_is_weights`` (``[B, T]``, rho) is optional.
    inputs: ClassVar[tuple[str, ...]] = INPUTS
    #: Steps are masked-in tokens only (multi-turn), not every position.
    compact: ClassVar[bool] = False
    handle_zero_tail: bool = bool_field(True)
    epsilon: float = float_field(1e-8, positive)

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
        old_log_probs: torch.Tensor | None = None,
        sum_pi_squared: torch.Tensor | None = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        name = type(self).name
        check_tokens(name, rewards, mask)
        for field, given in (("old_log_probs", old_log_probs), ("sum_pi_squared", sum_pi_squared)):
            if given is None or given.shape != rewards.shape:
                found = "none" if given is None else f"shape {tuple(given.shape)}"
                raise BatchError(
                    f"the {name!r} advantage estimator needs {field} of the rewards' shape "
                    f"{tuple(rewards.shape)} (the LM head's outputs of the rollout's old-log-prob "
                    f"pass; sum_pi_squared: compute_sum_pi_squared=True); got {found}"
                )
        assert old_log_probs is not None and sum_pi_squared is not None
        active = mask.bool()
        dtype = result_dtype(rewards, old_log_probs, sum_pi_squared)
        returns = reward_to_go(rewards.to(dtype), mask)
        old = torch.where(active, old_log_probs.to(dtype), 0.0)
        w = 1.0 - 2.0 * torch.exp(old) + torch.where(active, sum_pi_squared.to(dtype), 0.0)
        if rollout_is_weights is not None:
            w = w * torch.where(active, rollout_is_weights.to(dtype), 0.0).square()
        path_variance = torch.where(active, w, 0.0).cumsum(-1)
        groups = GroupStatistics.of(name, rewards, mask, group_ids)
        step = self._steps(active)
        length = active.sum(-1)
        steps = max(int(step.max()) + 1, 1)
        slot = groups.row_group[:, None] * steps + step.clamp(min=0)
        numerator = torch.zeros(groups.groups * steps, dtype=dtype, device=rewards.device)
        denominator = torch.zeros_like(numerator)
        taken = active & groups.responds[:, None]
        numerator.index_add_(0, slot[taken], (returns * path_variance)[taken])
        denominator.index_add_(0, slot[taken], path_variance[taken])
        baseline = (numerator / (denominator + self.epsilon))[slot]
        baseline = torch.where((groups.count >= 2)[:, None], baseline, 0.0)
        if self.handle_zero_tail:
            baseline = torch.where(self._past_others(groups, length, step), 0.0, baseline)
        return torch.where(active, returns - baseline, 0.0), returns

    def _steps(self, active: torch.Tensor) -> torch.Tensor:
        """Each position's step within its response (-1 before the first token)."""
        if self.compact:
            return torch.where(active, active.cumsum(-1) - 1, -1)
        positions = torch.arange(active.shape[1], device=active.device).expand_as(active)
        first = torch.where(active, positions, active.shape[1]).amin(-1, keepdim=True)
        return torch.where(positions >= first, positions - first, -1)

    @staticmethod
    def _past_others(
        groups: GroupStatistics, length: torch.Tensor, step: torch.Tensor
    ) -> torch.Tensor:
        """The steps of a group's one longest response past its second-longest one."""
        lengths = torch.where(groups.responds, length, -1).to(torch.float64)
        longest = groups.reduce(lengths, "amax")
        at_longest = groups.sum((lengths == longest).to(torch.float64))
        others = groups.reduce(torch.where(lengths == longest, -1.0, lengths), "amax")
        alone = (lengths == longest) & (at_longest == 1) & (groups.count >= 2)
        return alone[:, None] & (step >= others[:, None]) & (step >= 0)


@attrs.frozen(kw_only=True)
class MultiTurnOptimalTokenBaseline(OptimalTokenBaseline):
    """``tir_optimal_token_baseline``: steps are the response's masked-in tokens (multi-turn
    and tool-integrated rollouts: tool output between turns is not a step)."""

    name: ClassVar[str] = "tir_optimal_token_baseline"
    compact: ClassVar[bool] = True
