"""Losses and advantage estimators for RL post-training.

A loss function is ``loss_fn(outputs, batch, ctx) -> (loss, metrics)`` (the contract in
:mod:`engine.losses.contract`); building blocks in :mod:`~engine.losses.aggregation` and
:mod:`~engine.losses.kl`; PPO-style losses in :mod:`~engine.losses.ppo`, whose policy term is a
registered policy loss (:mod:`~engine.losses.policy`); supervised ones in
:mod:`~engine.losses.supervised`; reward-model ones in :mod:`~engine.losses.reward`; advantage
estimators in :mod:`~engine.losses.advantages`; KL coefficient controllers in
:mod:`~engine.losses.kl_control`; rollout correction (importance weights
``pi_old / pi_rollout``) in :mod:`~engine.losses.rollout_correction`; the name registries of
estimators and policy losses in :mod:`~engine.losses.registries`. Configure the functions with
``functools.partial``; any callable with the same signature works.
"""

from engine.losses.advantages import (
    GAE,
    GRPO,
    RLOO,
    AdvantageEstimator,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    gae_advantages,
    outcome_scores,
    whiten,
)
from engine.losses.aggregation import AGG_MODES, aggregate, masked_mean, token_mean, zero_masked
from engine.losses.contract import (
    LOSS_MASK,
    RESPONSE_MASK,
    SCORED_TOKENS,
    SEQUENCES,
    LossContext,
    LossFn,
    declared_fields,
    field_granularity,
    is_token_separable,
    needs_fields,
    required_fields,
    token_separable,
)
from engine.losses.kl import KL_TYPES, kl_penalized_rewards, kl_penalty
from engine.losses.kl_control import AdaptiveKLController, FixedKLController, kl_controller
from engine.losses.policy import (
    PolicyLoss,
    PolicyTerms,
    cispo,
    dual_clip_by_default,
    gspo,
    vanilla,
)
from engine.losses.ppo import ActorLoss, CriticLoss, entropy_bonus, kl_loss
from engine.losses.registries import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    register_advantage_estimator,
    register_policy_loss,
)
from engine.losses.reward import bradley_terry_loss, score_regression_loss
from engine.losses.rollout_correction import (
    ROLLOUT_LOG_PROBS,
    RolloutCorrection,
    RolloutWeights,
    rollout_metrics,
    rollout_weights,
)
from engine.losses.supervised import sft_loss, value_regression_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "GAE",
    "GRPO",
    "KL_TYPES",
    "LOSS_MASK",
    "POLICY_LOSSES",
    "RESPONSE_MASK",
    "RLOO",
    "ROLLOUT_LOG_PROBS",
    "SCORED_TOKENS",
    "SEQUENCES",
    "ActorLoss",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "CriticLoss",
    "FixedKLController",
    "LossContext",
    "LossFn",
    "PolicyLoss",
    "PolicyTerms",
    "ReinforcePlusPlus",
    "ReinforcePlusPlusBaseline",
    "RolloutCorrection",
    "RolloutWeights",
    "aggregate",
    "bradley_terry_loss",
    "cispo",
    "declared_fields",
    "dual_clip_by_default",
    "entropy_bonus",
    "field_granularity",
    "gae_advantages",
    "gspo",
    "kl_controller",
    "kl_loss",
    "kl_penalized_rewards",
    "kl_penalty",
    "masked_mean",
    "is_token_separable",
    "needs_fields",
    "outcome_scores",
    "register_advantage_estimator",
    "register_policy_loss",
    "required_fields",
    "token_separable",
    "rollout_metrics",
    "rollout_weights",
    "score_regression_loss",
    "sft_loss",
    "token_mean",
    "vanilla",
    "value_regression_loss",
    "whiten",
    "zero_masked",
]
