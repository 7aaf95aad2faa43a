"""PPO advantage estimation on padded ``[B, T]`` tensors aligned like the engine's outputs.

``values[:, t]`` is ``V(x_<t)``, the state in which token ``t`` (the action) was chosen, and
``rewards[:, t]`` the reward for choosing it, so an action's successor state is the next
*masked-in* position of the same row; masked-out positions (prompt, padding) are skipped.
"""

from __future__ import annotations

import torch

from heads.errors import BatchError


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
    rewards, values = rewards.float(), values.float()
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
    """Shift and scale the masked-in entries to mean 0 and standard deviation 1 (others 0)."""
    active = mask.bool()
    count = int(active.sum())
    if count < 2:
        return torch.where(active, values - values[active].mean() if count else values, 0.0)
    selected = values[active]
    normalised = (values - selected.mean()) / (selected.std() + eps)
    return torch.where(active, normalised, 0.0)
