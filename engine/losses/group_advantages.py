"""Advantage estimators that compare the responses to one prompt (its group).

``group_ids[i]`` (a ``[B]`` integer tensor, any labels, any order) names row ``i``'s group. A
row's outcome score is the sum of its token rewards over the mask. Rows with no masked-in token
are not responses: their advantages are 0 and they are left out of their group's statistics. A
group with one response, or whose responses all scored the same, carries no signal: its
advantages are exactly 0 (verl gives a lone response its own score, scaled; see docs/rl.md).
``returns`` is the outcome score on every response token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from engine.losses.advantages import check_tokens, outcome_scores, result_dtype, whiten
from heads.errors import BatchError, ConfigError
from heads.validation import bool_field, float_field, positive


@attrs.frozen(kw_only=True)
class GroupStatistics:
    """Per row: its score and its group's count, total, mean and unbiased std, over the group's
    responding rows; and what more the estimators ask of a group (sums, maxima)."""

    scores: torch.Tensor
    responds: torch.Tensor
    row_group: torch.Tensor
    groups: int
    count: torch.Tensor
    total: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    #: Rows whose advantage is 0 by definition: no tokens, alone, or all scores equal.
    silent: torch.Tensor

    @classmethod
    def of(
        cls, name: str, rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None
    ) -> GroupStatistics:
        """The statistics of the rows' outcome scores."""
        check_tokens(name, rewards, mask)
        return cls.of_scores(name, outcome_scores(rewards, mask), mask.bool().any(-1), group_ids)

    @classmethod
    def of_scores(
        cls,
        name: str,
        scores: torch.Tensor,
        responds: torch.Tensor,
        group_ids: torch.Tensor | None,
    ) -> GroupStatistics:
        """The statistics of per-row ``scores`` (``responds``: the rows that are responses)."""
        if group_ids is None or group_ids.shape != scores.shape[:1]:
            found = "none" if group_ids is None else f"shape {tuple(group_ids.shape)}"
            raise BatchError(
                f"the {name!r} advantage estimator needs group_ids, one group label per row "
                f"(shape ({scores.shape[0]},)); got {found}"
            )
        _, row_group = torch.unique(group_ids, return_inverse=True)
        row_group = row_group.to(scores.device)
        groups = int(row_group.max()) + 1 if row_group.numel() else 0
        partial = cls(
            scores=scores,
            responds=responds,
            row_group=row_group,
            groups=groups,
            count=scores,
            total=scores,
            mean=scores,
            std=scores,
            silent=responds,
        )
        count = partial.sum(torch.ones_like(scores))
        total = partial.sum(scores)
        mean = total / count.clamp(min=1)
        variance = partial.sum((scores - mean).square()) / (count - 1).clamp(min=1)
        spread = partial.reduce(scores, "amax") - partial.reduce(scores, "amin")
        silent = ~responds | (count < 2) | (spread == 0)
        return attrs.evolve(
            partial, count=count, total=total, mean=mean, std=variance.sqrt(), silent=silent
        )

    def sum(self, per_row: torch.Tensor) -> torch.Tensor:
        """Each row's group's sum of ``per_row`` over its responding rows."""
        summed = torch.zeros(self.groups, dtype=per_row.dtype, device=per_row.device)
        picked = torch.where(self.responds, per_row, 0.0)
        return summed.index_add(0, self.row_group, picked)[self.row_group]

    def reduce(self, per_row: torch.Tensor, how: str) -> torch.Tensor:
        """Each row's group's ``amax`` / ``amin`` of ``per_row`` over its responding rows."""
        fill = -torch.inf if how == "amax" else torch.inf
        start = torch.full((self.groups,), fill, dtype=per_row.dtype, device=per_row.device)
        picked = torch.where(self.responds, per_row, fill)
        return start.scatter_reduce(0, self.row_group, picked, how)[self.row_group]

    def advantages(self, per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``per_row`` advantages, 0 on silent rows, on every masked-in token of their row."""
        return self.per_token(torch.where(self.silent, 0.0, per_row), mask)

    def per_token(self, per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``per_row`` on every masked-in token of its row (0 elsewhere)."""
        return torch.where(mask.bool(), per_row[:, None], 0.0)

    def normalised(self, eps: float, scale_by_std: bool) -> torch.Tensor:
        """GRPO's per-row advantage: ``score - group mean``, over ``group std + eps``."""
        centred = self.scores - self.mean
        return centred / (self.std + eps) if scale_by_std else centred


class _GroupEstimator:
    """What every estimator of this module declares: no critic, groups."""

    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = True


@attrs.frozen(kw_only=True)
class GRPO(_GroupEstimator):
    """``grpo`` (and ``grpo_vectorized``, verl's other implementation of the same numbers):
    ``(score - group mean) / (group std + eps)`` with the unbiased std, for every response
    token; ``scale_by_std=False`` gives ``score - group mean`` (Dr. GRPO). verl names the
    options ``epsilon`` and ``norm_adv_by_std_in_grpo``."""

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
        groups = GroupStatistics.of("grpo", rewards, mask, group_ids)
        advantage = groups.normalised(self.eps, self.scale_by_std)
        return groups.advantages(advantage, mask), groups.per_token(groups.scores, mask)


@attrs.frozen(kw_only=True)
class RLOO(_GroupEstimator):
    """``rloo`` (and ``rloo_vectorized``): ``score - mean of the other responses' scores``
    (leave-one-out baseline)."""

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = GroupStatistics.of("rloo", rewards, mask, group_ids)
        others = (groups.total - groups.scores) / (groups.count - 1).clamp(min=1)
        return (
            groups.advantages(groups.scores - others, mask),
            groups.per_token(groups.scores, mask),
        )


@attrs.frozen(kw_only=True)
class ReinforcePlusPlusBaseline(_GroupEstimator):
    """``reinforce_plus_plus_baseline``: ``score - group mean`` on every response token, then
    whitened over the batch's masked-in tokens."""

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = GroupStatistics.of("reinforce_plus_plus_baseline", rewards, mask, group_ids)
        centred = groups.advantages(groups.scores - groups.mean, mask)
        return whiten(centred, mask), groups.per_token(groups.scores, mask)


def _weights(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or not value
        or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in value)
    ):
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name} must be a non-empty list of numbers "
            f"(one per reward component) or None, got {value!r}"
        )


def _tuple_if_list(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@attrs.frozen(kw_only=True)
class GDPO(_GroupEstimator):
    """``gdpo`` (Group reward-Decoupled normalization, 2026): each reward component normalised
    within its group as GRPO does, the components added with ``reward_weights`` (verl's
    ``gdpo_reward_weights``; None: 1 each), the sum whitened over the batch's response tokens.
    The components are the keyword input ``reward_components`` (``[B, K]`` scores, one column
    per component, e.g. format and accuracy); without it, the outcome score is the only one."""

    eps: float = float_field(1e-6, positive)
    scale_by_std: bool = bool_field(True)
    reward_weights: tuple[float, ...] | None = attrs.field(
        default=None,
        validator=_weights,
        converter=_tuple_if_list,
    )

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
        reward_components: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_tokens("gdpo", rewards, mask)
        responds = mask.bool().any(-1)
        if reward_components is None:
            components = outcome_scores(rewards, mask)[:, None]
        else:
            components = reward_components.to(result_dtype(rewards, reward_components))
            if components.dim() != 2 or components.shape[0] != rewards.shape[0]:
                raise BatchError(
                    "the 'gdpo' advantage estimator's reward_components must be [batch, "
                    f"components] ({rewards.shape[0]} rows); got {tuple(components.shape)}"
                )
        weights = self.reward_weights or (1.0,) * components.shape[1]
        if len(weights) != components.shape[1]:
            raise ConfigError(
                f"GDPO.reward_weights has {len(weights)} weights for {components.shape[1]} "
                "reward components"
            )
        combined = torch.zeros_like(components[:, 0])
        for column, weight in zip(components.unbind(-1), weights, strict=True):
            groups = GroupStatistics.of_scores("gdpo", column, responds, group_ids)
            advantage = groups.normalised(self.eps, self.scale_by_std)
            combined = combined + weight * torch.where(groups.silent, 0.0, advantage)
        advantages = whiten(torch.where(mask.bool(), combined[:, None], 0.0), mask)
        scores = outcome_scores(rewards, mask)
        return advantages, torch.where(mask.bool(), scores[:, None], 0.0)


@attrs.frozen(kw_only=True)
class GRPOPassK(_GroupEstimator):
    """``grpo_passk`` (Chen et al. 2025, pass@k training): only each group's best response gets
    an advantage, ``best score - second best`` (over the group std + ``eps`` when
    ``scale_by_std``), the others 0."""

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
        groups = GroupStatistics.of("grpo_passk", rewards, mask, group_ids)
        best = groups.reduce(groups.scores, "amax")
        rows = torch.arange(len(groups.scores), device=groups.scores.device)
        # the first row reaching the group's best score is its best response
        candidate = torch.where(groups.responds & (groups.scores == best), rows, len(rows))
        first = torch.full((groups.groups,), len(rows), device=rows.device, dtype=rows.dtype)
        first = first.scatter_reduce(0, groups.row_group, candidate, "amin")[groups.row_group]
        is_best = rows == first
        second = groups.reduce(torch.where(is_best, -torch.inf, groups.scores), "amax")
        gap = best - second
        if self.scale_by_std:
            gap = gap / (groups.std + self.eps)
        advantage = torch.where(is_best, gap, 0.0)
        return groups.advantages(advantage, mask), groups.per_token(groups.scores, mask)


@attrs.frozen(kw_only=True)
class OPO(_GroupEstimator):
    """``opo`` (On-Policy RL with Optimal reward baseline, 2025): ``score - b`` with the
    length-weighted baseline ``b = sum_i len_i score_i / sum_i len_i`` of the group, ``len`` a
    response's masked-in token count."""

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = GroupStatistics.of("opo", rewards, mask, group_ids)
        lengths = mask.bool().sum(-1).to(groups.scores.dtype)
        baseline = groups.sum(lengths * groups.scores) / groups.sum(lengths).clamp(min=1)
        advantages = groups.advantages(groups.scores - baseline, mask)
        return advantages, groups.per_token(groups.scores, mask)


@attrs.frozen(kw_only=True)
class GPG(_GroupEstimator):
    """``gpg`` (Group Policy Gradient, 2025): ``alpha (score - group mean) / f_norm`` with
    ``alpha`` the batch's responses over those scoring non-zero (verl computes ``alpha`` so,
    whatever it is given)."""

    f_norm: float = float_field(1.0, positive)

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = GroupStatistics.of("gpg", rewards, mask, group_ids)
        dtype = groups.scores.dtype
        responses = groups.responds.sum().to(dtype)
        scoring = (groups.responds & (groups.scores != 0)).sum().to(dtype)
        alpha = responses / scoring.clamp(min=1)
        advantage = alpha * (groups.scores - groups.mean) / self.f_norm
        return groups.advantages(advantage, mask), groups.per_token(groups.scores, mask)
