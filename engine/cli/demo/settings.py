"""The demo's settings: algorithm, task, RL and per-role engine settings, layered from defaults,
a saved run, a YAML file and command-line flags."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from engine.cli.loggers import LOGGERS
from engine.config import EngineConfig, read_yaml_mapping, structure
from engine.losses import (
    ADVANTAGE_ESTIMATORS,
    KL_TYPES,
    AdvantageEstimator,
    RolloutCorrection,
    estimator_inputs,
)
from engine.losses.actor_critic import build_policy_loss
from engine.losses.kl_control import AdaptiveKLController
from engine.losses.registries import policy_loss_field
from heads.errors import ConfigError
from heads.validation import float_field, int_field, of_type, one_of, positive, seed_field

ROLES = ("actor", "critic", "reference")
HEADS = {"actor": "lm", "critic": "value", "reference": "lm"}
#: ``--algorithm`` names of the demo's own -> their advantage estimator; any registered
#: estimator's name is an algorithm too. Only one that reads values gets a critic.
ALGORITHMS = {
    "ppo": "gae",
    "grpo": "grpo",
    "rloo": "rloo",
    "reinforce_pp": "reinforce_plus_plus_baseline",
}


def algorithm_names() -> list[str]:
    """Every ``--algorithm``: the demo's names, then the estimators'."""
    return [*ALGORITHMS, *(n for n in ADVANTAGE_ESTIMATORS.names() if n not in ALGORITHMS)]


def _algorithm(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in algorithm_names():
        raise ConfigError(
            f"DemoConfig.{attribute.name}: unknown algorithm {value!r}; known: "
            f"{', '.join(algorithm_names())}"
        )


#: Sequences per iteration when ``task.prompts`` is not given (``prompts x group_size``).
SEQUENCES_PER_ITERATION = 64
#: ``task.group_size`` when not given: responses per prompt without / with a critic. Measured
#: (benchmarks.demo_seeds, seeds 0-9): with 4 responses, runs of RLOO and GPG reached the task and
#: fell back to about 0.6 (a group whose responses all score alike has no advantage to learn
#: from); with 8 those runs learned it, and 94 of 100 runs of ten critic-free algorithms reached
#: 0.95 (65 before; docs/cli.md has the spread and what still falls back).
CRITIC_FREE_GROUP_SIZE, CRITIC_GROUP_SIZE = 8, 1

#: Engine settings of every role unless the config file says otherwise.
ENGINE_DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "micro_batch_size": 64,
    "scheduler": {"decay_style": "constant"},
}
#: A cosine decay of the actor's lr to a tenth was measured as a default and rejected
#: (benchmarks.demo_seeds, seeds 0-9): it held GPG's and OPO's late runs (10 of 10 each), but
#: GRPO, GDPO, both REINFORCE++ baselines, ReMax and the optimal token baseline each lost one
#: to three seeds (docs/cli.md).
ROLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "actor": {"optimizer": {"lr": 1e-3}, "head": {"compute_entropy": True}},
    "critic": {"optimizer": {"lr": 3e-3}},
    "reference": {},
}
#: An algorithm's own defaults over the above: ``group_size`` and role sections. pass@k GRPO
#: trains only each group's best response (its advantage is zero for the others), so with
#: groups of 8 it learns from 8 of the 64 responses of an iteration. Measured on seeds 0-1:
#: groups of 8 reached 0.78-0.82 at iteration 120 (lr 1e-3), 0.85-0.90 at lr 2e-3; groups of 4
#: (16 trained responses) at lr 2e-3 0.96-0.97, and on seeds 0-9 0.926 / 0.963 / 0.975 (min /
#: median / max), 8 of 10 at 0.95.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo_passk": {"group_size": 4, "actor": {"optimizer": {"lr": 2e-3}}},
}

#: Under the run's output directory (beside run_harness's metrics file and plot).
RUN_FILE, CHECKPOINTS = "run.json", "checkpoints"


def _logger_names(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """None (the default sinks) or a non-empty tuple of known logger names."""
    if value is None:
        return
    unknown = [name for name in value if name not in LOGGERS]
    if not value or unknown:
        raise ConfigError(
            f"DemoConfig.{attribute.name} must name one or more of {', '.join(LOGGERS)}; "
            f"got {list(value)!r}"
        )


def _optional_int() -> Any:
    return attrs.field(default=None, validator=attrs.validators.optional([of_type(int), positive]))


@attrs.frozen(kw_only=True)
class TaskConfig:
    """The rollout batch: ``group_size`` responses to each of ``prompts`` prompts, sequences of
    ``prompt_length + response_length`` tokens. Unset, the algorithm decides: ``group_size`` 1
    with a critic, else 4; ``prompts`` as many as make 64 sequences."""

    prompts: int | None = _optional_int()
    group_size: int | None = _optional_int()
    prompt_length: int = int_field(8)
    response_length: int = int_field(8)


@attrs.frozen(kw_only=True)
class PPOConfig:
    """The training loop's settings, for every algorithm (``gamma`` and ``lam`` are GAE's).

    ``kl_placement``: ``loss`` adds ``kl_coeff`` times the KL to the actor's loss; ``reward``
    subtracts ``coefficient x KL`` from the token rewards before advantage estimation, the
    coefficient starting at ``kl_coeff`` and kept (``kl_controller: fixed``) or adapted towards
    ``kl_target`` over ``kl_horizon`` samples (``adaptive``).
    """

    #: Four passes over the whole batch: as many optimizer steps as 2 epochs x 2 mini-batches,
    #: each on twice the sequences. Measured (benchmarks.demo_seeds, PPO, seeds 0-9): every
    #: seed learns the parity task (last 10 iterations >= 0.99); with 2 x 2, 7 of 10 reached 0.95
    #: and the others fell back after nearing 1 (the noisier half-batch steps).
    epochs: int = int_field(4)
    mini_batches: int = int_field(1)
    gamma: float = float_field(1.0)
    lam: float = float_field(0.95)
    clip_ratio: float = float_field(0.2, positive)
    value_clip: float = float_field(0.5, positive)
    #: Measured (benchmarks.demo_seeds, seeds 0-9): at 0.01 the critic-free algorithms whose
    #: advantages are not scaled by the group's spread (RLOO, OPO, GPG, ReMax, the optimal token
    #: baselines) levelled off near 0.95, where the KL term balances an advantage that shrinks
    #: with the errors left; at 0.001 OPO, ReMax and the optimal token baselines reached 0.95 on
    #: every seed, and PPO learns as before.
    kl_coeff: float = float_field(0.001)
    kl_type: str = attrs.field(default="low_var_kl", validator=one_of(*KL_TYPES))
    kl_placement: str = attrs.field(default="loss", validator=one_of("loss", "reward"))
    kl_controller: str = attrs.field(default="fixed", validator=one_of("fixed", "adaptive"))
    kl_target: float = float_field(0.1, positive)
    kl_horizon: int = int_field(10_000)
    entropy_coeff: float = float_field(0.0)
    #: ``ActorLoss.policy_loss``: ``vanilla`` (PPO), ``gspo``, ``sapo``, ... or a registered one.
    policy_loss: str = policy_loss_field()
    #: ``ActorLoss.policy_options``: the policy loss's own settings (e.g. ``{dro_beta: 0.1}``).
    policy_options: dict[str, Any] = attrs.field(factory=dict)
    #: Options of the algorithm's advantage estimator (e.g. ``{scale_by_std: false}`` for grpo).
    estimator_options: dict[str, Any] = attrs.field(factory=dict)
    #: Importance weights ``pi_old / pi_rollout`` on the policy loss, from the generator's
    #: log-probs of the sampled tokens (``{level, mode, upper, lower}``, as
    #: ``engine.losses.RolloutCorrection``); None: no correction.
    rollout_correction: RolloutCorrection | None = attrs.field(
        default=None, validator=attrs.validators.optional(of_type(RolloutCorrection))
    )

    def __attrs_post_init__(self) -> None:
        for name in ("gamma", "lam"):
            if getattr(self, name) > 1:
                raise ConfigError(f"PPOConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.clip_ratio >= 1:
            raise ConfigError(f"PPOConfig.clip_ratio must be < 1, got {self.clip_ratio}")
        try:
            build_policy_loss(self.policy_loss, self.policy_options)
        except ConfigError as error:
            raise ConfigError(f"PPOConfig.policy_options: {error}") from None


@attrs.frozen(kw_only=True)
class DemoConfig:
    """Everything ``demo`` runs with; a YAML file gives any of it, command-line flags win.

    ``engine`` holds ``EngineConfig`` settings for all roles; ``actor``, ``critic`` and
    ``reference`` override them per role (``reference`` is always forward-only; ``critic`` is
    built only for an algorithm whose advantage estimator reads values). An actor with LoRA
    (``actor: {lora: ...}``) is its own reference: the reference log-probs are the actor's with
    its adapters off (``Engine.disable_adapter``), and no reference engine is built. A critic
    with LoRA (``critic: {lora: ...}``; ``--lora-rank`` sets both) trains its adapters and its
    value layer.
    """

    algorithm: str = attrs.field(default="ppo", validator=[of_type(str), _algorithm])
    steps: int = int_field(120)
    seed: int = seed_field(0)
    device: str = attrs.field(default="auto", validator=of_type(str))
    backend: str = attrs.field(default="megatron", validator=of_type(str))
    output_dir: str = attrs.field(default="demo-output", validator=of_type(str))
    #: Where metrics go (``--logger``); None: the default sinks. Saved in ``run.json`` like the
    #: rest, so a resumed run keeps writing where the original did unless ``--logger`` says
    #: otherwise.
    loggers: tuple[str, ...] | None = attrs.field(default=None, validator=_logger_names)
    save_every: int = int_field(25)
    keep_checkpoints: int = int_field(2)
    task: TaskConfig = attrs.field(factory=TaskConfig)
    ppo: PPOConfig = attrs.field(factory=PPOConfig)
    engine: dict[str, Any] = attrs.field(factory=dict)
    actor: dict[str, Any] = attrs.field(factory=dict)
    critic: dict[str, Any] = attrs.field(factory=dict)
    reference: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.estimator().needs_groups and self.group_size < 2:
            raise ConfigError(
                f"algorithm {self.algorithm!r} compares the responses to one prompt: "
                f"task.group_size must be >= 2, got {self.group_size}"
            )
        ppo = self.ppo
        if ppo.kl_placement == "reward" and ppo.kl_controller == "adaptive":
            AdaptiveKLController(
                value=ppo.kl_coeff, target=ppo.kl_target, horizon=ppo.kl_horizon
            ).check_horizon(self.prompts * self.group_size, "ppo.kl_horizon")
        configs = {role: self.engine_config(role) for role in self.roles}
        if self.reference_is_actor and self.reference:
            raise ConfigError(
                "section 'reference' is unused when the actor has LoRA (the reference is the "
                "actor with its adapters off); remove it"
            )
        model = configs["actor"].model
        if model.max_sequence_length < self.task.prompt_length + self.task.response_length:
            raise ConfigError(
                f"task.prompt_length + task.response_length "
                f"({self.task.prompt_length + self.task.response_length}) exceeds the model's "
                f"max_sequence_length ({model.max_sequence_length})"
            )
        for role in self.roles[1:]:
            if _shape(configs[role].model) != _shape(model):
                raise ConfigError(
                    f"the {role}'s model must have the actor's shape (the demo starts every "
                    f"role from the same weights); section {role!r} changes it"
                )

    @property
    def group_size(self) -> int:
        """Responses per prompt: ``task.group_size``, else the algorithm's own default, else 1
        with a critic and 8 without."""
        if self.task.group_size is not None:
            return self.task.group_size
        own = ALGORITHM_DEFAULTS.get(self.algorithm, {}).get("group_size")
        if own is not None:
            return int(own)
        return CRITIC_GROUP_SIZE if self.estimator().needs_values else CRITIC_FREE_GROUP_SIZE

    @property
    def prompts(self) -> int:
        """Prompts per iteration: ``task.prompts``, else as many as make 64 sequences."""
        return self.task.prompts or max(SEQUENCES_PER_ITERATION // self.group_size, 1)

    @property
    def roles(self) -> tuple[str, ...]:
        """The engines the run builds: a critic only when the estimator reads values."""
        return ROLES if self.estimator().needs_values else ("actor", "reference")

    @property
    def reference_is_actor(self) -> bool:
        """An actor with LoRA adapters is its own reference, with the adapters off."""
        return self.engine_config("actor").lora is not None

    def estimator(self) -> AdvantageEstimator:
        """The algorithm's advantage estimator, with ``ppo.estimator_options``."""
        name = ALGORITHMS.get(self.algorithm, self.algorithm)
        defaults = {"gamma": self.ppo.gamma, "lam": self.ppo.lam} if name == "gae" else {}
        return ADVANTAGE_ESTIMATORS.create(name, {**defaults, **self.ppo.estimator_options})

    def engine_config(self, role: str) -> EngineConfig:
        """The role's ``EngineConfig``: defaults (the algorithm's own over the demo's) <-
        ``engine`` <- the role's section."""
        own = ALGORITHM_DEFAULTS.get(self.algorithm, {}).get(role, {})
        data = _merge(ENGINE_DEFAULTS, {"seed": self.seed}, ROLE_DEFAULTS[role], own)
        if role == "actor" and "sum_pi_squared" in estimator_inputs(self.estimator()):
            data = _merge(data, {"head": {"compute_sum_pi_squared": True}})
        data = _merge(data, self.engine, getattr(self, role))
        data["total_steps"] = self.steps * self.ppo.epochs * self.ppo.mini_batches
        if role == "reference":
            data["forward_only"] = True
        try:
            return EngineConfig.from_dict(data)
        except ConfigError as error:
            raise ConfigError(
                f"engine settings of the {role} (config sections 'engine' and {role!r}): {error}"
            ) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DemoConfig:
        data = dict(data)
        if isinstance(data.get("loggers"), str):  # as --logger spells it: console,tensorboard
            data["loggers"] = [name.strip() for name in data["loggers"].split(",")]
        config: DemoConfig = structure(data, cls)
        return config

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _shape(model: Any) -> tuple[Any, ...]:
    fields = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "hf_path")
    return tuple(getattr(model, name) for name in fields)


def _merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge mappings, later layers winning (nested mappings merge key by key)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
                merged[key] = _merge(merged[key], value)
            else:
                merged[key] = dict(value) if isinstance(value, Mapping) else value
    return merged


def resolve_config(
    file: str | None, overrides: Mapping[str, Any], resume: bool, output_dir: str | None
) -> DemoConfig:
    """Defaults <- the run's saved settings (``--resume``) <- the config file <- flags."""
    layers: list[Mapping[str, Any]] = []
    if resume:
        saved = Path(output_dir or DemoConfig().output_dir) / RUN_FILE
        if saved.exists():
            layers.append(json.loads(saved.read_text()))
    if file:
        layers.append(read_yaml_mapping(file))
    layers.append(overrides)
    return DemoConfig.from_dict(_merge(*layers))
