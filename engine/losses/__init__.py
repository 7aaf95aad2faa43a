"""Losses and advantage estimators for RL post-training.

A loss function is ``loss_fn(outputs, batch, ctx) -> (loss, metrics)`` (the contract in
:mod:`engine.losses.contract`); building blocks in :mod:`~engine.losses.aggregation` and
:mod:`~engine.losses.kl`; PPO losses in :mod:`~engine.losses.ppo`; supervised ones in
:mod:`~engine.losses.supervised`; reward-model ones in :mod:`~engine.losses.reward`; advantage
estimators in :mod:`~engine.losses.advantages`.
Configure the functions with ``functools.partial``; any callable with the same signature works.
"""

from engine.losses.advantages import gae_advantages, whiten
from engine.losses.aggregation import AGG_MODES, aggregate, masked_mean, token_mean, zero_masked
from engine.losses.contract import (
    LOSS_MASK,
    RESPONSE_MASK,
    SCORED_TOKENS,
    SEQUENCES,
    LossContext,
    LossFn,
    needs_fields,
    required_fields,
)
from engine.losses.kl import KL_TYPES, kl_penalty
from engine.losses.ppo import ActorLoss, CriticLoss, entropy_bonus, kl_loss
from engine.losses.reward import bradley_terry_loss, score_regression_loss
from engine.losses.supervised import sft_loss, value_regression_loss

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "LOSS_MASK",
    "RESPONSE_MASK",
    "SCORED_TOKENS",
    "SEQUENCES",
    "ActorLoss",
    "CriticLoss",
    "LossContext",
    "LossFn",
    "aggregate",
    "bradley_terry_loss",
    "entropy_bonus",
    "gae_advantages",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "needs_fields",
    "required_fields",
    "score_regression_loss",
    "sft_loss",
    "token_mean",
    "value_regression_loss",
    "whiten",
    "zero_masked",
]
