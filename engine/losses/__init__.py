"""Losses and advantage estimators for RL post-training.

A loss function is ``loss_fn(outputs, batch, ctx) -> (loss, metrics)`` (the contract in
:mod:`engine.losses.contract`); building blocks in :mod:`~engine.losses.aggregation` and
:mod:`~engine.losses.kl`; PPO-style losses in :mod:`~engine.losses.actor_critic`, whose
policy term is a registered policy loss (:mod:`~engine.losses.policy`); supervised ones in
:mod:`~engine.losses.supervised`; reward-model ones in :mod:`~engine.losses.reward_model`;
advantage estimators in :mod:`~engine.losses.advantages` (single rows),
:mod:`~engine.losses.group_advantages` (groups of responses) and
:mod:`~engine.losses.token_baselines` (per-timestep baselines); KL coefficient controllers in
:mod:`~engine.losses.kl_control`; rollout correction (importance weights
``pi_old / pi_rollout``) in :mod:`~engine.losses.rollout_correction`; the name registries of
estimators and policy losses in :mod:`~engine.losses.registries`. Configure the functions with
``functools.partial``; any callable with the same signature works.
"""

from engine.losses.actor_critic import ActorLoss, CriticLoss, entropy_bonus, kl_loss
from engine.losses.advantages import (
    GAE,
    AdvantageEstimator,
    ReinforcePlusPlus,
    ReMax,
    estimator_inputs,
    gae_advantages,
    outcome_scores,
    reward_to_go,
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
    needs_outputs,
    required_fields,
    required_outputs,
    token_separable,
)
from engine.losses.group_advantages import (
    GDPO,
    GPG,
    GRPO,
    OPO,
    RLOO,
    GRPOPassK,
    ReinforcePlusPlusBaseline,
)
from engine.losses.kl import KL_TYPES, kl_penalized_rewards, kl_penalty
from engine.losses.kl_control import AdaptiveKLController, FixedKLController, kl_controller
from engine.losses.policy import (
    DRO,
    SAPO,
    BypassMode,
    ClipCov,
    KLCov,
    PolicyLoss,
    PolicyTerms,
    aggregated_by_default,
    cispo,
    dppo_kl,
    dppo_tv,
    dual_clip_by_default,
    geo_mean,
    gpg,
    gspo,
    vanilla,
)
from engine.losses.registries import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    register_advantage_estimator,
    register_policy_loss,
)
from engine.losses.reward_model import bradley_terry_loss, score_regression_loss
from engine.losses.rollout_correction import (
    ROLLOUT_IS_WEIGHTS,
    ROLLOUT_LOG_PROBS,
    RolloutCorrection,
    RolloutWeights,
    rollout_metrics,
    rollout_weights,
)
from engine.losses.supervised import sft_loss, value_regression_loss
from engine.losses.token_baselines import MultiTurnOptimalTokenBaseline, OptimalTokenBaseline

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "ActorLoss",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "BypassMode",
    "ClipCov",
    "CriticLoss",
    "DRO",
    "FixedKLController",
    "GAE",
    "GDPO",
    "GPG",
    "GRPO",
    "GRPOPassK",
    "KLCov",
    "KL_TYPES",
    "LOSS_MASK",
    "LossContext",
    "LossFn",
    "MultiTurnOptimalTokenBaseline",
    "OPO",
    "OptimalTokenBaseline",
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyTerms",
    "RESPONSE_MASK",
    "RLOO",
    "ROLLOUT_IS_WEIGHTS",
    "ROLLOUT_LOG_PROBS",
    "ReMax",
    "ReinforcePlusPlus",
    "ReinforcePlusPlusBaseline",
    "RolloutCorrection",
    "RolloutWeights",
    "SAPO",
    "SCORED_TOKENS",
    "SEQUENCES",
    "aggregate",
    "aggregated_by_default",
    "bradley_terry_loss",
    "cispo",
    "declared_fields",
    "dppo_kl",
    "dppo_tv",
    "dual_clip_by_default",
    "entropy_bonus",
    "estimator_inputs",
    "field_granularity",
    "gae_advantages",
    "geo_mean",
    "gpg",
    "gspo",
    "is_token_separable",
    "kl_controller",
    "kl_loss",
    "kl_penalized_rewards",
    "kl_penalty",
    "masked_mean",
    "needs_fields",
    "needs_outputs",
    "outcome_scores",
    "register_advantage_estimator",
    "register_policy_loss",
    "required_fields",
    "required_outputs",
    "reward_to_go",
    "rollout_metrics",
    "rollout_weights",
    "score_regression_loss",
    "sft_loss",
    "token_mean",
    "token_separable",
    "value_regression_loss",
    "vanilla",
    "whiten",
    "zero_masked",
]
