"""Name -> advantage estimator and name -> policy loss, with the heads' registry mechanism:
built-ins imported on first use, plugins from the entry-point groups
``composable_engine.advantage_estimators`` and ``composable_engine.policy_losses``, a duplicate
name refused, an unknown one answered with the closest known name."""

from __future__ import annotations

from typing import Any

from engine.losses.advantages import AdvantageEstimator
from engine.losses.policy import PolicyTerms
from engine.registry import Registry

#: Advantage estimator classes (attrs, options as fields); ``create(name, options)`` builds one.
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator",
    "composable_engine.advantage_estimators",
    {
        "gae": "engine.losses.advantages:GAE",
        "grpo": "engine.losses.advantages:GRPO",
        "rloo": "engine.losses.advantages:RLOO",
        "reinforce_plus_plus": "engine.losses.advantages:ReinforcePlusPlus",
        "reinforce_plus_plus_baseline": "engine.losses.advantages:ReinforcePlusPlusBaseline",
    },
)
#: Policy loss functions (:class:`~engine.losses.policy.PolicyLoss`); ``get(name)`` gives one.
POLICY_LOSSES: Registry[PolicyTerms] = Registry(
    "policy loss",
    "composable_engine.policy_losses",
    {
        "vanilla": "engine.losses.policy:vanilla",
        "gspo": "engine.losses.policy:gspo",
        "cispo": "engine.losses.policy:cispo",
    },
)


def register_advantage_estimator(name: str, *, override: bool = False) -> Any:
    """Decorator registering an advantage estimator class (or factory) under ``name``."""
    return ADVANTAGE_ESTIMATORS.register(name, override=override)


def register_policy_loss(name: str, *, override: bool = False) -> Any:
    """Decorator registering a policy loss function under ``name`` (for ``ActorLoss``)."""
    return POLICY_LOSSES.register(name, override=override)
