"""GAE and whitening on padded tensors aligned like the engine's outputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.losses.advantages import gae_advantages, whiten
from heads.errors import BatchError


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


@st.composite
def rollouts(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, width, generator=generator)
    values = torch.randn(rows, width, generator=generator)
    mask = torch.rand(rows, width, generator=generator) < draw(st.floats(0.0, 1.0))
    return rewards, values, mask


@settings(max_examples=40, deadline=None)
@given(rollouts(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_equals_the_textbook_recursion_over_masked_in_positions(
    rollout: tuple[torch.Tensor, torch.Tensor, torch.Tensor], gamma: float, lam: float
) -> None:
    rewards, values, mask = rollout
    advantages, returns = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    expected = _reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, torch.where(mask, expected + values, 0.0))


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
