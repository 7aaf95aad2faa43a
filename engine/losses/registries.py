"""Name -> advantage estimator and name -> policy loss, with the heads' registry mechanism:
built-ins imported on first use, plugins from the entry-point groups
``composable_engine.advantage_estimators`` and ``composable_engine.policy_losses``, a duplicate
name refused, an unknown one answered with the closest known name."""

from __future__ import annotations

from typing import Any

import attrs

from engine.losses.advantages import AdvantageEstimator
from engine.losses.policy import PolicyTerms
from engine.registry import Registry
from heads.errors import UnknownStrategyError
from heads.validation import of_type

#: Advantage estimator classes (attrs, options as fields); ``create(name, options)`` builds one.
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator",
    "composable_engine.advantage_estimators",
    {
        "gae": "engine.losses.advantages:GAE",
        "reinforce_plus_plus": "engine.losses.advantages:ReinforcePlusPlus",
        "remax": "engine.losses.advantages:ReMax",
        "grpo": "engine.losses.group_advantages:GRPO",
        "grpo_vectorized": "engine.losses.group_advantages:GRPO",
        "rloo": "engine.losses.group_advantages:RLOO",
        "rloo_vectorized": "engine.losses.group_advantages:RLOO",
        "reinforce_plus_plus_baseline": "engine.losses.group_advantages:ReinforcePlusPlusBaseline",
        "gdpo": "engine.losses.group_advantages:GDPO",
        "grpo_passk": "engine.losses.group_advantages:GRPOPassK",
        "opo": "engine.losses.group_advantages:OPO",
        "gpg": "engine.losses.group_advantages:GPG",
        "optimal_token_baseline": "engine.losses.token_baselines:OptimalTokenBaseline",
        "tir_optimal_token_baseline": (
            "engine.losses.token_baselines:MultiTurnOptimalTokenBaseline"
        ),
    },
)
#: Policy losses (:class:`~engine.losses.policy.PolicyLoss`): functions, or attrs classes whose
#: instances are (built from ``ActorLoss.policy_options``); ``get(name)`` gives one.
POLICY_LOSSES: Registry[PolicyTerms] = Registry(
    "policy loss function",
    "composable_engine.policy_losses",
    {
        "vanilla": "engine.losses.policy:vanilla",
        "gspo": "engine.losses.policy:gspo",
        "cispo": "engine.losses.policy:cispo",
        "sapo": "engine.losses.policy:SAPO",
        "gpg": "engine.losses.policy:gpg",
        "clip_cov": "engine.losses.policy:ClipCov",
        "kl_cov": "engine.losses.policy:KLCov",
        "geo_mean": "engine.losses.policy:geo_mean",
        "dro": "engine.losses.policy:DRO",
        "dppo_tv": "engine.losses.policy:dppo_tv",
        "dppo_kl": "engine.losses.policy:dppo_kl",
        "bypass_mode": "engine.losses.policy:BypassMode",
    },
)


def register_advantage_estimator(name: str, *, override: bool = False) -> Any:
    """Decorator registering an advantage estimator class (or factory) under ``name``."""
    return ADVANTAGE_ESTIMATORS.register(name, override=override)


def register_policy_loss(name: str, *, override: bool = False) -> Any:
    """Decorator registering a policy loss function under ``name`` (for ``ActorLoss``)."""
    return POLICY_LOSSES.register(name, override=override)


def policy_loss_field(default: str = "vanilla") -> Any:
    """An attrs field holding a policy loss name, checked against the registry."""
    return attrs.field(default=default, validator=[of_type(str), registered(POLICY_LOSSES)])


def registered(registry: Registry[Any]) -> Any:
    """attrs validator: the value is a name ``registry`` knows (else the did-you-mean error,
    prefixed with the field)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
        try:
            registry.get(value)
        except UnknownStrategyError as error:
            raise UnknownStrategyError(
                f"{type(instance).__name__}.{attribute.name}: {error}"
            ) from None

    return check
