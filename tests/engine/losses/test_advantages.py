"""Advantage estimators on padded tensors aligned like the engine's outputs, each against a
textbook reference written here with Python numbers, one row and one group at a time."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.losses import (
    ADVANTAGE_ESTIMATORS,
    GAE,
    GDPO,
    GPG,
    GRPO,
    OPO,
    RLOO,
    GRPOPassK,
    MultiTurnOptimalTokenBaseline,
    OptimalTokenBaseline,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    ReMax,
    gae_advantages,
    outcome_scores,
    register_advantage_estimator,
    whiten,
)
from engine.losses.advantages import AdvantageEstimator, estimator_inputs
from heads.errors import BatchError, ConfigError, UnknownStrategyError
from tests.tolerances import reordered

WHITEN_EPS = 1e-8


# -- textbook references ---------------------------------------------------------------------------
def _reference_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Textbook GAE over each row's masked-in positions, one row at a time."""
    out = torch.zeros_like(values)
    for row in range(values.shape[0]):
        steps = [t for t in range(values.shape[1]) if mask[row, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[row, t]) + gamma * next_value - float(values[row, t])
            running = delta + gamma * lam * running
            out[row, t] = running
            next_value = float(values[row, t])
    return out


@dataclass
class Rows:
    """A batch as Python lists: each row's masked-in rewards (their positions) and group."""

    rewards: torch.Tensor
    mask: torch.Tensor
    group_ids: torch.Tensor

    def steps(self, row: int) -> list[int]:
        return [t for t in range(self.mask.shape[1]) if self.mask[row, t]]

    def score(self, row: int) -> float:
        return sum(float(self.rewards[row, t]) for t in self.steps(row))

    def peers(self, row: int) -> list[int]:
        """The rows of ``row``'s group that have tokens (``row`` included)."""
        label = int(self.group_ids[row])
        return [
            other
            for other in range(self.mask.shape[0])
            if int(self.group_ids[other]) == label and self.steps(other)
        ]

    def silent(self, row: int) -> bool:
        scores = {self.score(peer) for peer in self.peers(row)}
        return not self.steps(row) or len(self.peers(row)) < 2 or len(scores) == 1

    def broadcast(self, per_row: Callable[[int], float]) -> torch.Tensor:
        out = torch.zeros(self.mask.shape, dtype=torch.float64)
        for row in range(self.mask.shape[0]):
            for t in self.steps(row):
                out[row, t] = 0.0 if self.silent(row) else per_row(row)
        return out

    def scores_per_token(self) -> torch.Tensor:
        out = torch.zeros(self.mask.shape, dtype=torch.float64)
        for row in range(self.mask.shape[0]):
            for t in self.steps(row):
                out[row, t] = self.score(row)
        return out


def reference_grpo(rows: Rows, eps: float, scale_by_std: bool) -> torch.Tensor:
    def advantage(row: int) -> float:
        scores = [rows.score(peer) for peer in rows.peers(row)]
        centred = rows.score(row) - statistics.mean(scores)
        return centred / (statistics.stdev(scores) + eps) if scale_by_std else centred

    return rows.broadcast(advantage)


def reference_rloo(rows: Rows) -> torch.Tensor:
    def advantage(row: int) -> float:
        others = [rows.score(peer) for peer in rows.peers(row) if peer != row]
        return rows.score(row) - statistics.mean(others)

    return rows.broadcast(advantage)


def reference_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    chosen = [float(v) for v, m in zip(values.flatten(), mask.flatten(), strict=True) if m]
    out = torch.zeros(values.shape, dtype=torch.float64)
    if len(chosen) < 2:
        return out
    mean, variance = statistics.mean(chosen), statistics.variance(chosen)
    for index in mask.nonzero().tolist():
        out[tuple(index)] = (float(values[tuple(index)]) - mean) / (variance + WHITEN_EPS) ** 0.5
    return out


def reference_discounted_returns(rows: Rows, gamma: float) -> torch.Tensor:
    out = torch.zeros(rows.mask.shape, dtype=torch.float64)
    for row in range(rows.mask.shape[0]):
        running = 0.0
        for t in reversed(rows.steps(row)):
            running = float(rows.rewards[row, t]) + gamma * running
            out[row, t] = running
    return out


def reference_rpp_centred(rows: Rows) -> torch.Tensor:
    """Each row's score minus its group's mean on its tokens (REINFORCE++-baseline whitens it)."""

    def centred(row: int) -> float:
        return rows.score(row) - statistics.mean(rows.score(peer) for peer in rows.peers(row))

    return rows.broadcast(centred)


def reference_passk(rows: Rows, eps: float, scale_by_std: bool) -> torch.Tensor:
    def advantage(row: int) -> float:
        peers = rows.peers(row)
        scores = [rows.score(peer) for peer in peers]
        best = max(scores)
        if peers[scores.index(best)] != row:  # the first row reaching the best score
            return 0.0
        gap = best - max(s for peer, s in zip(peers, scores, strict=True) if peer != row)
        return gap / (statistics.stdev(scores) + eps) if scale_by_std else gap

    return rows.broadcast(advantage)


def reference_opo(rows: Rows) -> torch.Tensor:
    def advantage(row: int) -> float:
        peers = rows.peers(row)
        lengths = [len(rows.steps(peer)) for peer in peers]
        scores = [rows.score(peer) for peer in peers]
        baseline = sum(n * s for n, s in zip(lengths, scores, strict=True)) / sum(lengths)
        return rows.score(row) - baseline

    return rows.broadcast(advantage)


def reference_gpg(rows: Rows, f_norm: float) -> torch.Tensor:
    responding = [row for row in range(rows.mask.shape[0]) if rows.steps(row)]
    scoring = [row for row in responding if rows.score(row) != 0]
    alpha = len(responding) / max(len(scoring), 1)

    def advantage(row: int) -> float:
        mean = statistics.mean(rows.score(peer) for peer in rows.peers(row))
        return alpha * (rows.score(row) - mean) / f_norm

    return rows.broadcast(advantage)


def reference_reward_to_go(rows: Rows) -> torch.Tensor:
    return reference_discounted_returns(rows, 1.0)


def reference_optimal_token_baseline(
    rows: Rows, w: torch.Tensor, compact: bool, zero_tail: bool, eps: float = 1e-8
) -> torch.Tensor:
    """``G_t - sum_peers G_t W_t / (sum_peers W_t + eps)`` per step (``W`` the cumulative
    ``w`` over the response's masked-in tokens), one row and one step at a time."""
    returns = reference_reward_to_go(rows)

    def trajectory(row: int) -> dict[int, tuple[float, float]]:
        """Step -> (G, W) of ``row``'s masked-in tokens."""
        steps, cumulative, first = {}, 0.0, rows.steps(row)[0]
        for rank, t in enumerate(rows.steps(row)):
            cumulative += float(w[row, t])
            steps[rank if compact else t - first] = (float(returns[row, t]), cumulative)
        return steps

    out = torch.zeros(rows.mask.shape, dtype=torch.float64)
    for row in range(rows.mask.shape[0]):
        if not rows.steps(row):
            continue
        peers = rows.peers(row)
        paths = {peer: trajectory(peer) for peer in peers}
        lengths = sorted(len(rows.steps(peer)) for peer in peers)
        longest_alone = len(peers) > 1 and lengths[-1] > lengths[-2]
        mine = paths[row]
        for (step, (g, _)), t in zip(mine.items(), rows.steps(row), strict=True):
            baseline = 0.0
            if len(peers) > 1:
                seen = [path[step] for path in paths.values() if step in path]
                baseline = sum(gp * wp for gp, wp in seen) / (sum(wp for _, wp in seen) + eps)
                tail = longest_alone and len(rows.steps(row)) == lengths[-1]
                if zero_tail and tail and step >= lengths[-2]:
                    baseline = 0.0
            out[row, t] = g - baseline
    return out


# -- random padded batches -------------------------------------------------------------------------
@st.composite
def group_batches(draw: st.DrawFn) -> Rows:
    """Rows in groups with arbitrary labels in any order; some rows fully masked, some groups
    of one, some groups whose rows all score the same; float32 or float64 rewards."""
    rows, width = draw(st.integers(1, 7)), draw(st.integers(1, 6))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    if draw(st.booleans()):  # few distinct values: equal scores are common
        rewards = torch.randint(0, 3, (rows, width), generator=generator).to(dtype) / 2
    else:
        rewards = torch.randn(rows, width, generator=generator, dtype=dtype)
    keep = torch.tensor(
        draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=rows, max_size=rows))
    )
    mask = torch.rand(rows, width, generator=generator) < keep[:, None]
    labels = draw(st.lists(st.sampled_from([-7, 0, 3, 1000]), min_size=rows, max_size=rows))
    group_ids = torch.tensor(labels)
    if draw(st.booleans()):  # one group's rows are copies of its first: all scores equal
        members = (group_ids == group_ids[0]).nonzero()[:, 0]
        rewards[members], mask[members] = rewards[0].clone(), mask[0].clone()
    return Rows(rewards=rewards, mask=mask, group_ids=group_ids)


def tolerance(
    dtype: torch.dtype, whitened: tuple[torch.Tensor, torch.Tensor] | None = None
) -> dict[str, float]:
    """The dtype's tolerance; for a result whitened from ``whitened = (values, mask)``, plus the
    rounding of its ``n`` inputs' mean (``n * eps * max|x|``: the deviations ``x - mean`` are
    computed to that, and the variance from them) amplified by whitening's ``1 / sqrt(var +
    eps)``, with the variance's own error scaled by the largest result (``<= sqrt(n)``). Values
    equal up to rounding have ``var ~ 0`` and an amplification of ``1e4``: their whitened float32
    entries are rounding noise times 1e4, where the float64 reference has 0."""
    base = {"rtol": 1e-9, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    if whitened is None or dtype == torch.float64:
        return base
    chosen = whitened[0][whitened[1].bool()].double()
    if chosen.numel() < 2:
        return base
    n = chosen.numel()
    spread = float(chosen.abs().max()) / (float(chosen.var()) + WHITEN_EPS) ** 0.5
    return {**base, "atol": base["atol"] + 2 * reordered(n) * spread * (1 + n**0.5)}


def assert_matches(
    got: torch.Tensor,
    expected: torch.Tensor,
    rows: Rows,
    whitened: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    assert got.dtype == rows.rewards.dtype
    assert torch.isfinite(got).all()
    assert not got[~rows.mask].any(), "masked-out positions must be 0"
    torch.testing.assert_close(got.double(), expected, **tolerance(rows.rewards.dtype, whitened))


group_estimators = settings(max_examples=60, deadline=None)


# -- group estimators ------------------------------------------------------------------------------
@group_estimators
@given(rows=group_batches(), eps=st.sampled_from([1e-6, 0.1]), scale=st.booleans())
def test_grpo_is_the_score_minus_its_group_mean_over_the_unbiased_std_plus_eps(
    rows: Rows, eps: float, scale: bool
) -> None:
    estimator = GRPO(eps=eps, scale_by_std=scale)
    advantages, returns = estimator(rows.rewards, rows.mask, group_ids=rows.group_ids)
    assert_matches(advantages, reference_grpo(rows, eps, scale), rows)
    assert_matches(returns, rows.scores_per_token(), rows)


@group_estimators
@given(rows=group_batches())
def test_rloo_is_the_score_minus_the_mean_of_the_other_scores_of_its_group(rows: Rows) -> None:
    advantages, returns = RLOO()(rows.rewards, rows.mask, group_ids=rows.group_ids)
    assert_matches(advantages, reference_rloo(rows), rows)
    assert_matches(returns, rows.scores_per_token(), rows)


@group_estimators
@given(rows=group_batches(), gamma=st.sampled_from([1.0, 0.9, 0.0]))
def test_reinforce_pp_whitens_the_discounted_reward_to_go_over_the_batch(
    rows: Rows, gamma: float
) -> None:
    advantages, returns = ReinforcePlusPlus(gamma=gamma)(rows.rewards, rows.mask)
    expected_returns = reference_discounted_returns(rows, gamma)
    assert_matches(returns, expected_returns, rows)
    whitened = (expected_returns, rows.mask)
    assert_matches(advantages, reference_whiten(*whitened), rows, whitened)


@group_estimators
@given(rows=group_batches())
def test_reinforce_pp_baseline_whitens_the_score_minus_its_group_mean_over_the_batch(
    rows: Rows,
) -> None:
    estimator = ReinforcePlusPlusBaseline()
    advantages, returns = estimator(rows.rewards, rows.mask, group_ids=rows.group_ids)
    whitened = (reference_rpp_centred(rows), rows.mask)
    assert_matches(advantages, reference_whiten(*whitened), rows, whitened)
    assert_matches(returns, rows.scores_per_token(), rows)


#: Every registered estimator that compares the responses to one prompt.
GROUP_ESTIMATORS = sorted(
    name for name in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.create(name).needs_groups
)


@group_estimators
@given(rows=group_batches(), eps=st.sampled_from([1e-6, 0.1]), scale=st.booleans())
def test_grpo_passk_gives_each_groups_best_response_its_lead_over_the_second(
    rows: Rows, eps: float, scale: bool
) -> None:
    advantages, returns = GRPOPassK(eps=eps, scale_by_std=scale)(
        rows.rewards, rows.mask, group_ids=rows.group_ids
    )
    assert_matches(advantages, reference_passk(rows, eps, scale), rows)
    assert_matches(returns, rows.scores_per_token(), rows)


@group_estimators
@given(rows=group_batches())
def test_opo_subtracts_the_length_weighted_group_mean(rows: Rows) -> None:
    advantages, _ = OPO()(rows.rewards, rows.mask, group_ids=rows.group_ids)
    assert_matches(advantages, reference_opo(rows), rows)


@group_estimators
@given(rows=group_batches(), f_norm=st.sampled_from([1.0, 2.5]))
def test_gpg_scales_the_centred_score_by_the_share_of_non_zero_scores(
    rows: Rows, f_norm: float
) -> None:
    advantages, _ = GPG(f_norm=f_norm)(rows.rewards, rows.mask, group_ids=rows.group_ids)
    assert_matches(advantages, reference_gpg(rows, f_norm), rows)


@group_estimators
@given(rows=group_batches())
def test_gdpo_of_one_component_whitens_grpo_over_the_batch(rows: Rows) -> None:
    advantages, _ = GDPO()(rows.rewards, rows.mask, group_ids=rows.group_ids)
    whitened = (reference_grpo(rows, 1e-6, True), rows.mask)
    assert_matches(advantages, reference_whiten(*whitened), rows, whitened)
    scores = outcome_scores(rows.rewards, rows.mask)[:, None]
    twice, _ = GDPO(reward_weights=[0.5, 0.5])(
        rows.rewards, rows.mask, group_ids=rows.group_ids, reward_components=scores.repeat(1, 2)
    )
    torch.testing.assert_close(twice, advantages, **tolerance(rows.rewards.dtype))


@group_estimators
@given(rows=group_batches())
def test_remax_subtracts_the_greedy_responses_score_from_the_reward_to_go(rows: Rows) -> None:
    baselines = torch.linspace(-1, 1, rows.mask.shape[0], dtype=rows.rewards.dtype)
    advantages, returns = ReMax()(rows.rewards, rows.mask, reward_baselines=baselines)
    expected = reference_reward_to_go(rows) - baselines[:, None].double() * rows.mask
    assert_matches(advantages, expected, rows)
    assert_matches(returns, reference_reward_to_go(rows), rows)
    with pytest.raises(BatchError, match="reward_baselines"):
        ReMax()(rows.rewards, rows.mask)


@pytest.mark.parametrize("estimator", [OptimalTokenBaseline, MultiTurnOptimalTokenBaseline])
@group_estimators
@given(rows=group_batches(), zero_tail=st.booleans(), seed=st.integers(0, 2**16))
def test_optimal_token_baselines_weight_each_step_by_the_paths_accumulated_variance(
    estimator: type, rows: Rows, zero_tail: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    dtype = rows.rewards.dtype
    old = -3 * torch.rand(rows.mask.shape, generator=generator, dtype=dtype)
    squares = torch.rand(rows.mask.shape, generator=generator, dtype=dtype)
    advantages, returns = estimator(handle_zero_tail=zero_tail)(
        rows.rewards, rows.mask, group_ids=rows.group_ids, old_log_probs=old, sum_pi_squared=squares
    )
    w = 1 - 2 * old.double().exp() + squares.double()
    compact = estimator is MultiTurnOptimalTokenBaseline
    expected = reference_optimal_token_baseline(rows, w, compact, zero_tail)
    assert_matches(advantages, expected, rows)
    assert_matches(returns, reference_reward_to_go(rows), rows)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@group_estimators
@given(rows=group_batches(), seed=st.integers(0, 2**16))
def test_groups_are_found_by_their_ids_not_by_row_position(
    name: str, rows: Rows, seed: int
) -> None:
    estimator = ADVANTAGE_ESTIMATORS.create(name)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(rows.mask.shape[0], generator=generator)
    inputs = {  # per-token inputs that differ from row to row
        key: value + torch.rand(value.shape, generator=generator, dtype=value.dtype) * 0.1
        for key, value in inputs_for(estimator, rows.rewards).items()
    }
    advantages, _ = estimator(rows.rewards, rows.mask, group_ids=rows.group_ids, **inputs)
    shuffled, _ = estimator(
        rows.rewards[order],
        rows.mask[order],
        group_ids=rows.group_ids[order],
        **{key: value[order] for key, value in inputs.items()},
    )
    torch.testing.assert_close(shuffled, advantages[order], **tolerance(rows.rewards.dtype))


def test_the_silent_cases_give_exactly_zero_advantages() -> None:
    rewards = torch.tensor(
        [[0.0, 0.1], [0.0, 0.1], [0.0, 0.1], [0.0, 0.7], [0.0, 1.0], [0.0, 0.0]],
        dtype=torch.float64,
    )
    mask = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, 0]])
    # group 0: equal scores (whose float mean is not exactly 0.1); group 1: one response;
    # group 2: one response and an all-masked row, which is not a response.
    group_ids = torch.tensor([0, 0, 0, 1, 2, 2])
    outcome = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "grpo_passk", "opo", "gpg")
    for name in outcome:
        for options in ({}, {"scale_by_std": False}) if name.startswith("grpo") else ({},):
            estimator = ADVANTAGE_ESTIMATORS.create(name, options)
            advantages, _ = estimator(rewards, mask, group_ids=group_ids)
            assert not advantages.any(), (name, options)


def inputs_for(estimator: object, rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """Plausible values of what ``estimator`` reads beyond rewards, mask, values and groups."""
    known = {
        "reward_baselines": torch.full(rewards.shape[:1], 0.25, dtype=rewards.dtype),
        "old_log_probs": torch.full_like(rewards, -1.5),
        "sum_pi_squared": torch.full_like(rewards, 0.3),
    }
    return {name: known[name] for name in estimator_inputs(estimator)}


def test_float64_stays_float64_and_half_precision_is_computed_in_float32() -> None:
    rewards = torch.rand(4, 5, dtype=torch.float64)
    mask = torch.ones(4, 5)
    values = torch.rand(4, 5, dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    for name in ADVANTAGE_ESTIMATORS.names():
        estimator = ADVANTAGE_ESTIMATORS.create(name)
        for dtype, expected in ((torch.float64, torch.float64), (torch.bfloat16, torch.float32)):
            outputs = estimator(
                rewards.to(dtype),
                mask,
                values=values.to(dtype),
                group_ids=groups,
                **inputs_for(estimator, rewards.to(dtype)),
            )
            assert [o.dtype for o in outputs] == [expected, expected], (name, dtype)
    assert whiten(rewards, mask).dtype == torch.float64


def test_all_masked_rows_and_all_masked_batches_give_finite_zeros() -> None:
    rewards = torch.tensor([[1.0, float("nan")], [2.0, float("inf")]])
    values = torch.tensor([[0.5, float("nan")], [0.1, float("-inf")]])
    groups = torch.tensor([0, 0])
    for keep in ([[1, 0], [0, 0]], [[0, 0], [0, 0]]):
        mask = torch.tensor(keep)
        for name in ADVANTAGE_ESTIMATORS.names():
            estimator = ADVANTAGE_ESTIMATORS.create(name)
            inputs = {  # NaN where masked out (per-token inputs)
                field: torch.where(mask.bool(), value, float("nan")) if value.dim() == 2 else value
                for field, value in inputs_for(estimator, rewards).items()
            }
            for out in estimator(rewards, mask, values=values, group_ids=groups, **inputs):
                assert torch.isfinite(out).all(), name
                assert not out[1].any(), name


def test_group_estimators_need_one_group_id_per_row() -> None:
    rewards, mask = torch.zeros(3, 2), torch.ones(3, 2)
    with pytest.raises(BatchError, match="needs group_ids"):
        GRPO()(rewards, mask)
    with pytest.raises(BatchError, match=r"shape \(3,\)"):
        RLOO()(rewards, mask, group_ids=torch.tensor([0, 1]))
    with pytest.raises(BatchError, match="critic's values"):
        GAE()(rewards, mask)


# -- GAE and whitening -----------------------------------------------------------------------------
@st.composite
def rollouts(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, width, generator=generator, dtype=dtype)
    values = torch.randn(rows, width, generator=generator, dtype=dtype)
    mask = torch.rand(rows, width, generator=generator) < draw(st.floats(0.0, 1.0))
    return rewards, values, mask


@settings(max_examples=40, deadline=None)
@given(rollouts(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_equals_the_textbook_recursion_over_masked_in_positions(
    rollout: tuple[torch.Tensor, torch.Tensor, torch.Tensor], gamma: float, lam: float
) -> None:
    rewards, values, mask = rollout
    advantages, returns = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    expected = _reference_gae(rewards.double(), values.double(), mask, gamma, lam)
    assert advantages.dtype == returns.dtype == rewards.dtype
    torch.testing.assert_close(advantages.double(), expected, **tolerance(rewards.dtype))
    torch.testing.assert_close(
        returns.double(), torch.where(mask, expected + values, 0.0), **tolerance(rewards.dtype)
    )


@settings(max_examples=40, deadline=None)
@given(rollouts(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_the_gae_estimator_whitens_the_gae_advantages_unless_told_not_to(
    rollout: tuple[torch.Tensor, torch.Tensor, torch.Tensor], gamma: float, lam: float
) -> None:
    rewards, values, mask = rollout
    raw, returns = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    white, same_returns = GAE(gamma=gamma, lam=lam)(rewards, mask, values=values)
    torch.testing.assert_close(
        white.double(), reference_whiten(raw, mask), **tolerance(raw.dtype, (raw, mask))
    )
    torch.testing.assert_close(same_returns, returns)
    plain, _ = GAE(gamma=gamma, lam=lam, whiten_advantages=False)(rewards, mask, values=values)
    torch.testing.assert_close(plain, raw)


def test_with_gamma_and_lambda_one_returns_are_the_rewards_still_to_come() -> None:
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.2, 0.4, 0.1, 0.3, 9.0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0]])  # prompt token first, padding last
    advantages, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 0.8, 0.6, 0.9, 0.7, 0.0]]))


def test_gae_rejects_tensors_of_different_shapes() -> None:
    with pytest.raises(BatchError, match="one \\[batch, tokens\\] shape"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_whiten_gives_mean_zero_and_unit_std_over_the_mask_only() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 6.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]])
    white = whiten(values, mask)
    selected = white[mask.bool()]
    assert abs(float(selected.mean())) < 1e-6
    assert abs(float(selected.std()) - 1.0) < 1e-5
    assert white[~mask.bool()].tolist() == [0.0, 0.0]


# -- the registry ----------------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class MedianBaseline:
    """A research estimator: each row's score minus the median score of the whole batch."""

    needs_values = False
    needs_groups = False
    scale: float = 1.0

    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (rewards * mask).sum(-1)
        advantages = self.scale * (scores - scores.median())
        return advantages[:, None] * mask, scores[:, None] * mask


def test_research_code_registers_its_own_estimator_and_uses_it_by_name() -> None:
    try:
        register_advantage_estimator("median_baseline")(MedianBaseline)
        estimator: AdvantageEstimator = ADVANTAGE_ESTIMATORS.create(
            "median_baseline", {"scale": 2.0}
        )
        rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 8.0]])
        advantages, _ = estimator(rewards, torch.tensor([[0, 1]] * 3))
        assert advantages[:, 1].tolist() == [-4.0, 0.0, 10.0]
        assert not estimator.needs_values
        with pytest.raises(ConfigError, match="already registered"):
            register_advantage_estimator("median_baseline")(MedianBaseline)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("median_baseline")


def test_a_misspelt_estimator_name_is_answered_with_the_closest_one() -> None:
    with pytest.raises(UnknownStrategyError, match="did you mean 'grpo'"):
        ADVANTAGE_ESTIMATORS.create("gpro")
    with pytest.raises(ConfigError, match="scale_by_sdt"):
        ADVANTAGE_ESTIMATORS.create("grpo", {"scale_by_sdt": False})
    with pytest.raises(ConfigError, match=r"GAE\.lam must be in \[0, 1\]"):
        GAE(lam=1.5)


def test_the_built_in_estimators_declare_whether_they_need_a_critic_and_groups() -> None:
    needs = {
        name: (estimator.needs_values, estimator.needs_groups)
        for name in ADVANTAGE_ESTIMATORS.names()
        for estimator in [ADVANTAGE_ESTIMATORS.create(name)]
    }
    grouped = {"grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "gdpo", "grpo_passk"}
    grouped |= {"opo", "gpg", "reinforce_plus_plus_baseline"}
    grouped |= {"optimal_token_baseline", "tir_optimal_token_baseline"}
    assert needs == {
        "gae": (True, False),
        "reinforce_plus_plus": (False, False),
        "remax": (False, False),
        **dict.fromkeys(grouped, (False, True)),
    }
    inputs = {name: estimator_inputs(ADVANTAGE_ESTIMATORS.create(name)) for name in needs}
    assert {name: fields for name, fields in inputs.items() if fields} == {
        "remax": ("reward_baselines",),
        "optimal_token_baseline": ("old_log_probs", "sum_pi_squared"),
        "tir_optimal_token_baseline": ("old_log_probs", "sum_pi_squared"),
    }
