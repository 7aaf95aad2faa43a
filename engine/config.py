"""The engine's config: composes the parts' configs; built from dicts, YAML or OmegaConf."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from engine.registry import STRICT_CONVERTER, describe_structure_error
from heads.base import Head
from heads.errors import CheckpointError, ConfigError, did_you_mean
from heads.validation import (
    bool_field,
    int_field,
    of_type,
    one_of,
    optional_int_field,
    seed_field,
)
from strategies.backends.base import OFFLOAD_PARTS
from strategies.part_configs import (
    MODEL_PRESETS,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    SchedulerConfig,
    model_preset,
)


def _named_model(name: str) -> ModelConfig:
    """A preset name, or a local Hugging Face checkpoint directory (config and weights).

    A preset's name is the preset even where a directory of that name (an output directory,
    say) is in the way; a Hugging Face checkpoint of that name is ambiguous and refused, naming
    both (``./NAME`` is the directory)."""
    if os.path.isdir(name):
        from strategies.hf.config_json import model_config_from_hf

        if name not in MODEL_PRESETS:
            return model_config_from_hf(name)
        if os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(
                f"model {name!r} is both a preset and a Hugging Face checkpoint directory here; "
                f"write ./{name} for the directory, or run where there is none for the preset"
            )
    return model_preset(name)


def _model_config(value: ModelConfig | str | Mapping[str, Any]) -> ModelConfig:
    if isinstance(value, str):
        return _named_model(value)
    if isinstance(value, Mapping):
        return structure(value, ModelConfig)
    return value


def _optional_lora(value: LoraConfig | Mapping[str, Any] | None) -> LoraConfig | None:
    if isinstance(value, Mapping):
        lora: LoraConfig = structure(value, LoraConfig)
        return lora
    return value


def _part_options(value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"part options must be a mapping, got {type(value).__name__}")
    return dict(value)


def _section(kind: type[Any]) -> Any:
    """A nested config field that also accepts a plain mapping."""

    def convert(value: Any) -> Any:
        return structure(value, kind) if isinstance(value, Mapping) else value

    return attrs.field(factory=kind, converter=convert, validator=of_type(kind))


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """What ``train_mode`` / ``eval_mode`` keep in host memory outside their block (RL phases
    alternate: the actor's optimizer state need not occupy the device during rollouts)."""

    model: bool = bool_field(False)
    optimizer: bool = bool_field(False)
    grad: bool = bool_field(False)

    def parts(self) -> tuple[str, ...]:
        return tuple(part for part in OFFLOAD_PARTS if getattr(self, part))


@attrs.frozen(kw_only=True)
class NonFiniteConfig:
    """What a step with a non-finite loss, gradient norm or learning rate does. It is never
    applied: every rank skips it (weights, optimizer state and LR schedule unchanged), and
    ``policy="raise"`` raises ``NonFiniteError`` at once, ``"skip"`` only after more than
    ``max_consecutive_skips`` such steps in a row."""

    policy: str = attrs.field(default="skip", validator=one_of("skip", "raise"))
    max_consecutive_skips: int = int_field(5)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything an engine needs; each part's own options ride along as ``head`` / ``backend`` /
    ``device`` mappings, used when that part is given by name."""

    model: ModelConfig = attrs.field(
        factory=lambda: model_preset("tiny"),
        converter=_model_config,
        validator=of_type(ModelConfig),
    )
    parallel: ParallelConfig = _section(ParallelConfig)
    optimizer: OptimizerConfig = _section(OptimizerConfig)
    scheduler: SchedulerConfig = _section(SchedulerConfig)
    offload: OffloadConfig = _section(OffloadConfig)
    non_finite: NonFiniteConfig = _section(NonFiniteConfig)
    micro_batch_size: int = int_field(4)
    #: When set, micro-batches are planned by token budget (rows x longest row, padding
    #: included; real tokens when packing) instead of ``micro_batch_size``: the fewest that
    #: fit, balanced, and the same count on every data-parallel rank.
    max_tokens_per_micro_batch: int | None = optional_int_field()
    #: Sequence packing: each micro-batch runs as one row holding its sequences back to back,
    #: so no compute goes to padding (needs a backend with the ``packing`` ability).
    packing: bool = bool_field(False)
    #: Reference models: no optimizer, no gradients; ``train_batch`` is refused.
    forward_only: bool = bool_field(False)
    seed: int = seed_field(1234)
    dtype: str = attrs.field(default="float32", validator=one_of("float32", "bfloat16"))
    #: Optimizer steps the LR schedule is laid out over (when the schedule has no decay_steps).
    total_steps: int = int_field(1000)
    #: Mixture-of-experts router replay: every forward also returns ``routed_experts`` (the
    #: experts each token went to, per MoE layer), and a batch carrying ``routed_experts`` is
    #: routed exactly that way (needs a backend with the ``router_replay`` ability).
    router_replay: bool = bool_field(False)
    #: Low-rank adapters (None: the whole model trains); needs a backend with the ``lora``
    #: ability. Only the adapters train and are held by the optimizer.
    lora: LoraConfig | None = attrs.field(
        default=None,
        converter=_optional_lora,
        validator=attrs.validators.optional(of_type(LoraConfig)),
    )
    head: dict[str, Any] = attrs.field(factory=dict, converter=_part_options)
    backend: dict[str, Any] = attrs.field(factory=dict, converter=_part_options)
    device: dict[str, Any] = attrs.field(factory=dict, converter=_part_options)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Structure from a (nested) mapping; an OmegaConf/Hydra DictConfig is fine too."""
        return structure(_plain_container(data), cls)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        return cls.from_dict(read_yaml_mapping(path))

    def to_dict(self) -> dict[str, Any]:
        unstructured: dict[str, Any] = STRICT_CONVERTER.unstructure(self)
        return unstructured

    def replace(self, **changes: Any) -> EngineConfig:
        return attrs.evolve(self, **changes)


@attrs.frozen(kw_only=True)
class CallSettings:
    """One call's settings in place of the built ones (``settings=`` of ``train_batch``,
    ``forward_backward_batch``, ``infer_batch``): micro-batching and head options. The engine
    checks them as it checks the built ones and keeps none: its ``head`` and ``config`` stay."""

    #: Sequences per micro-batch (a token budget the config sets is not used for the call).
    micro_batch_size: int | None = optional_int_field()
    #: A token budget instead (see ``EngineConfig.max_tokens_per_micro_batch``).
    max_tokens_per_micro_batch: int | None = optional_int_field()
    #: Head options by name (the LM head's ``temperature``, ``compute_entropy``,
    #: ``compute_sum_pi_squared``); none that changes the model's output layer (``fused``).
    head: dict[str, Any] = attrs.field(factory=dict, converter=_part_options)

    def __attrs_post_init__(self) -> None:
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise ConfigError(
                "CallSettings takes micro_batch_size or max_tokens_per_micro_batch, not both "
                f"(got {self.micro_batch_size} and {self.max_tokens_per_micro_batch})"
            )

    def config_of(self, config: EngineConfig) -> EngineConfig:
        """``config`` with this call's micro-batching."""
        if self.micro_batch_size is not None:
            return config.replace(
                micro_batch_size=self.micro_batch_size, max_tokens_per_micro_batch=None
            )
        if self.max_tokens_per_micro_batch is not None:
            return config.replace(max_tokens_per_micro_batch=self.max_tokens_per_micro_batch)
        return config

    def head_of(self, head: Head) -> Head:
        """``head`` with this call's options (its own validators check their values);
        ConfigError naming an option it does not have."""
        if not self.head:
            return head
        known = head_options(head)
        unknown = set(self.head) - set(known)
        if unknown:
            raise ConfigError(
                f"head {head.name!r} has no option(s) {', '.join(sorted(unknown))}"
                f"{did_you_mean(unknown, known)}; its options: {', '.join(known) or 'none'}"
            )
        changed: Head = attrs.evolve(head, **self.head)  # type: ignore[misc]
        return changed


def head_options(head: Head) -> list[str]:
    """The options a head is built from and a call may set (an attrs head's fields)."""
    kind: Any = type(head)
    return [field.alias for field in attrs.fields(kind) if field.init] if attrs.has(kind) else []


def call_settings(settings: CallSettings | Mapping[str, Any]) -> CallSettings:
    """A CallSettings, or one from a mapping; ConfigError otherwise."""
    if isinstance(settings, CallSettings):
        return settings
    if isinstance(settings, Mapping):
        built: CallSettings = structure(settings, CallSettings)
        return built
    raise ConfigError(f"settings must be CallSettings, a mapping or None; got {settings!r}")


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-3`` as the number YAML 1.2 says it is (YAML 1.1, and
    so PyYAML, needs a dot: ``1.0e-3``); a config's float field takes no strings."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML file that holds a mapping (an empty file is an empty one); ConfigError otherwise."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from error
    try:
        data = yaml.load(text, Loader=_YamlLoader) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from error
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return dict(data)


def coerce_config(config: EngineConfig | Mapping[str, Any] | None) -> EngineConfig:
    """Accept an EngineConfig, a mapping (dict, DictConfig) or None (all defaults)."""
    if config is None:
        return EngineConfig()
    if isinstance(config, EngineConfig):
        return config
    if isinstance(config, Mapping) or hasattr(config, "_metadata"):
        return EngineConfig.from_dict(config)
    raise ConfigError(
        f"config must be an EngineConfig, a mapping or None; got {type(config).__name__}"
    )


def structure(data: Any, kind: type[Any]) -> Any:
    """``data`` as a ``kind``; ConfigError naming the fields, except that a CheckpointError
    raised while reading a field (a Hugging Face model directory) keeps its type."""
    try:
        return STRICT_CONVERTER.structure(data, kind)
    except Exception as error:
        for leaf in _leaves(error):
            if isinstance(leaf, CheckpointError):  # a model directory that cannot be read
                raise leaf from None
        raise ConfigError(f"invalid {kind.__name__}: {describe_structure_error(error)}") from error


def _leaves(error: BaseException) -> list[BaseException]:
    """The underlying errors of a cattrs validation error (the error itself otherwise)."""
    nested = getattr(error, "exceptions", None)
    if not nested:
        return [error]
    return [leaf for inner in nested for leaf in _leaves(inner)]


def _plain_container(data: Any) -> Any:
    if hasattr(data, "_metadata"):  # OmegaConf DictConfig: resolve interpolations first
        from omegaconf import OmegaConf

        return OmegaConf.to_container(data, resolve=True)
    return data


STRICT_CONVERTER.register_structure_hook(ModelConfig, lambda value, _: _structure_model(value))


def _structure_model(value: Any) -> ModelConfig:
    if isinstance(value, str):
        return _named_model(value)
    built: ModelConfig = _from_fields(value, ModelConfig, "model", "a preset name or a mapping")
    return built


STRICT_CONVERTER.register_structure_hook(
    LoraConfig, lambda value, _: _from_fields(value, LoraConfig, "lora", "a mapping")
)


def _from_fields(value: Any, kind: type[Any], what: str, expected: str) -> Any:
    """``kind(**value)`` as attrs builds it (its converters see the values as given: a string
    ``target_modules`` is refused, not split into letters); ConfigError for unknown fields."""
    if isinstance(value, kind):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be {expected}, got {type(value).__name__}")
    known = [a.name for a in attrs.fields(kind)]
    unknown = set(value) - set(known)
    if unknown:
        raise ConfigError(
            f"unknown {kind.__name__} field(s): {', '.join(sorted(unknown))} "
            f"(its fields: {', '.join(known)})"
        )
    return kind(**value)
