"""verl's config objects -> this project's ``EngineConfig`` (no verl import: read by attribute).

Every verl setting is either translated, or harmless to ignore because it only chooses how
verl's own engines compute (kernels, compilation, wrapping), or refused by name when this engine
cannot honour it: every refused setting of a configuration, each with its hint, in one
``ConfigError`` (:class:`Refusals`). ``use_fused_kernels`` (model, engine and the
batch flag) is one to ignore: it picks verl's fused LM-head kernels; this engine's LM head
computes log-probs and entropy from the hidden states and output weight either way (its
``fused`` option, on by default), the same numbers whatever verl asks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from engine import registry
from engine.config import EngineConfig
from engine.integrations.verl.cells import BACKENDS, HEADS
from heads.errors import ConfigError
from strategies.backends.base import Packing, Refuse, require
from strategies.part_configs import DTYPE_NAMES, LORA_TARGETS, LoraConfig


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """A config field (a dataclass, a DictConfig or a dict)."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _off(value: Any) -> bool:
    return not value


def _no_mapping_entries(value: Any) -> bool:
    return not value


#: (config kind, field, accepted?, what to do instead). A field absent from the object is fine.
REFUSED: list[tuple[str, str, Callable[[Any], bool], str]] = [
    (
        "model",
        "lora_adapter_path",
        lambda v: v is None,
        "an existing PEFT adapter is not loaded (give a model with it merged as model.path)",
    ),
    ("model", "use_liger", _off, "Liger kernels are verl's FSDP engine's"),
    ("model", "external_lib", lambda v: v is None, "external model code is not loaded"),
    ("model", "enable_activation_offload", _off, "activation offload is not supported"),
    ("model", "tiled_mlp", lambda v: not _get(v or {}, "enabled", False), "no tiled MLP"),
    ("model", "mtp", lambda v: not _get(v, "enable", False), "no multi-token prediction"),
    ("engine", "full_determinism", _off, "not configurable here (runs are seeded)"),
    (
        "engine",
        "router_replay",
        lambda v: _get(v, "record_file") is None and _get(v, "replay_file") is None,
        "routes travel in the batch's routed_experts, not in files (record_file / replay_file)",
    ),
    ("engine", "qat", lambda v: not _get(v, "enable", False), "no quantization-aware training"),
    ("engine", "expert_tensor_parallel_size", lambda v: v in (None, 1), "no expert TP"),
    ("engine", "dynamic_context_parallel", _off, "no dynamic context parallelism"),
    ("engine", "use_dist_checkpointing", _off, "checkpoints are this engine's own"),
    ("engine", "use_megatron_fsdp", _off, "use the fsdp2 backend"),
    ("engine", "override_ddp_config", _no_mapping_entries, "not configurable here"),
    ("engine", "override_mcore_model_config", _no_mapping_entries, "not configurable here"),
    ("optimizer", "optimizer", lambda v: str(v).lower() in ("adamw", "adam"), "AdamW only"),
    ("optimizer", "optimizer_impl", lambda v: v == "torch.optim", "torch.optim.AdamW only"),
    ("optimizer", "num_cycles", lambda v: v == 0.5, "a half-cosine only"),
    ("optimizer", "lr_warmup_init", lambda v: not v, "warmup starts from 0"),
    ("optimizer", "weight_decay_incr_style", lambda v: v == "constant", "constant decay only"),
    ("checkpoint", "async_save", _off, "use a backend with async checkpoints directly"),
]

_SCHEDULES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}


class Refusals:
    """Every verl setting of one configuration that this engine cannot honour, each with its
    hint, raised together as one ConfigError (a user learns them all from one failed start)."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str, Any, str]] = []

    def add(self, kind: str, setting: str, value: Any, hint: str) -> None:
        self.found.append((kind, setting, value, hint))

    def check(
        self,
        kind: str,
        obj: Any,
        checks: Sequence[tuple[str, Callable[[Any], bool], str]],
        prefix: str = "",
    ) -> None:
        """Each field of ``obj`` that ``checks`` (name, accepted?, hint) does not accept, named
        ``prefix`` + its name; a field absent from ``obj`` is fine."""
        sentinel = object()
        for name, accepted, hint in checks:
            value = _get(obj, name, sentinel)
            if value is not sentinel and not accepted(value):
                self.add(kind, prefix + name, value, hint)

    def raise_any(self) -> None:
        if len(self.found) == 1:
            ((kind, setting, value, hint),) = self.found
            raise ConfigError(
                f"verl {kind} setting {setting}={value!r} is not supported by the composable "
                f"engine: {hint}"
            )
        if self.found:
            lines = "".join(
                f"\n  - verl {kind} setting {setting}={value!r}: {hint}"
                for kind, setting, value, hint in self.found
            )
            raise ConfigError(
                f"{len(self.found)} verl settings are not supported by the composable engine:"
                + lines
            )


def refuse_unsupported(refusals: Refusals, **configs: Any) -> None:
    """Every setting in ``configs`` (kind -> object) of the :data:`REFUSED` table."""
    for kind, name, accepted, hint in REFUSED:
        obj = configs.get(kind)
        if obj is not None:
            refusals.check(kind, obj, [(name, accepted, hint)])


#: verl's megatron LoRA module names (``model.lora.target_modules``) -> Hugging Face names, by
#: ``lora.type`` (Megatron-Bridge's): ``canonical_lora`` puts one adapter on each projection;
#: ``lora`` one on each megatron linear, the projections a fused one computes (q/k/v, gate/up)
#: sharing its ``A`` (``LoraConfig.share_a``).
MEGATRON_LORA_TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "canonical_lora": {
        "linear_q": ("q_proj",),
        "linear_k": ("k_proj",),
        "linear_v": ("v_proj",),
        "linear_proj": ("o_proj",),
        "linear_fc1_gate": ("gate_proj",),
        "linear_fc1_up": ("up_proj",),
        "linear_fc2": ("down_proj",),
    },
    "lora": {
        "linear_qkv": ("q_proj", "k_proj", "v_proj"),
        "linear_proj": ("o_proj",),
        "linear_fc1": ("gate_proj", "up_proj"),
        "linear_fc2": ("down_proj",),
    },
}


#: What a LoRA-enabled rollout (vLLM's, verl's own engines' base sync) calls an adapted
#: linear's own weight: ``...q_proj.base_layer.weight``.
LORA_WRAPPER = ".base_layer"


def lora_merged(model_config: Any) -> bool:
    """verl's ``model.lora.merge``: adapters reach the rollout merged into their linears."""
    return bool(_get(_get(model_config, "lora", None) or {}, "merge", False))


def lora_base_name(name: str, targets: Sequence[str]) -> str:
    """``name`` as verl's base sync sends it to a LoRA rollout: the weight or bias of a linear
    adapters may wrap (one of the seven projections, or a target) under ``.base_layer``
    (verl/utils/fsdp_utils.py ``replace_lora_wrapper``); any other name unchanged."""
    module, _, leaf = name.rpartition(".")
    if leaf in ("weight", "bias") and module.rpartition(".")[2] in (*LORA_TARGETS, *targets):
        return f"{module}{LORA_WRAPPER}.{leaf}"
    return name


def lora_unwrapped_name(name: str) -> str:
    """The inverse of :func:`lora_base_name`: the linear's own name."""
    return name.replace(f"{LORA_WRAPPER}.", ".")


def lora_from_verl(model_config: Any, refusals: Refusals) -> dict[str, Any] | None:
    """``EngineConfig.lora`` for verl's LoRA settings (None: no LoRA). verl has two spellings,
    either is read whatever the strategy: the flat fields its FSDP engine reads (``lora_rank``,
    ``lora_alpha``, ``target_modules``, ``exclude_modules``, ``target_parameters``) and the
    ``lora`` block its megatron engine reads (``rank``, ``alpha``, ``dropout``,
    ``target_modules``, ...). What cannot be honoured goes to ``refusals``, naming verl's
    field."""
    flat_rank = int(_get(model_config, "lora_rank", 0) or 0)
    block = _get(model_config, "lora", None) or {}
    block_rank = int(_get(block, "rank", 0) or 0)
    if flat_rank > 0 and block_rank > 0:
        refusals.add(
            "model",
            "lora.rank",
            block_rank,
            f"lora_rank={flat_rank} is set too; the composable engine takes one (either "
            "spelling works with every strategy)",
        )
        return None
    if flat_rank > 0:
        lora = _flat_lora(model_config, flat_rank, refusals)
        settings = {"target_modules": "target_modules", "alpha": "lora_alpha"}
    elif block_rank > 0:
        lora = _block_lora(block, block_rank, refusals)
        settings = {field: f"lora.{field}" for field in ("target_modules", "alpha", "dropout")}
    else:
        return None
    try:
        LoraConfig(**lora)
    except ConfigError as error:
        field = next((field for field in settings if field in str(error)), "target_modules")
        refusals.add("model", settings[field], lora.get(field), str(error))
    return lora


def _flat_lora(model_config: Any, rank: int, refusals: Refusals) -> dict[str, Any]:
    """verl's FSDP spelling, which builds a peft ``LoraConfig`` (no dropout: peft's 0)."""
    whole = "adapters go on whole target linears only"
    checks = [(name, _off, whole) for name in ("exclude_modules", "target_parameters")]
    refusals.check("model", model_config, checks)
    lora: dict[str, Any] = {"rank": rank, "alpha": _get(model_config, "lora_alpha", 16)}
    targets = _get(model_config, "target_modules", "all-linear")
    if isinstance(targets, str):
        if targets != "all-linear":
            refusals.add(
                "model",
                "target_modules",
                targets,
                "'all-linear' or a list of module names (no regex)",
            )
    elif targets is not None:
        lora["target_modules"] = [str(name) for name in targets]
    return lora


#: verl's ``lora.lora_A_init_method`` -> ``LoraConfig.a_init``.
_A_INITS = {"kaiming": "kaiming", "xavier": "xavier"}


def _block_lora(block: Any, rank: int, refusals: Refusals) -> dict[str, Any]:
    """verl's megatron spelling (Megatron-Bridge's LoRA settings), its defaults included
    (``type: lora`` on the four megatron linears, ``A`` drawn Xavier-uniform)."""
    kind = str(_get(block, "type", "lora"))
    if kind not in MEGATRON_LORA_TARGETS:
        refusals.add("model", "lora.type", kind, "plain LoRA only (lora or canonical_lora)")
    checks: list[tuple[str, Callable[[Any], bool], str]] = [
        ("exclude_modules", lambda v: not v, "name the targets in lora.target_modules"),
        ("dropout_position", lambda v: v == "pre", "dropout is on the adapter's input ('pre')"),
        ("lora_A_init_method", lambda v: v in _A_INITS, "xavier or kaiming"),
        ("lora_B_init_method", lambda v: v == "zero", "B starts at zero"),
        ("a2a_experimental", lambda v: not v, "not supported"),
        ("dtype", lambda v: v is None, "adapters are kept in the weights' dtype"),
        (
            "adapter_path",
            lambda v: v is None,
            "an existing adapter is not loaded (give a model with it merged as model.path)",
        ),
    ]
    refusals.check("model", block, checks, prefix="lora.")
    lora: dict[str, Any] = {
        "rank": rank,
        "alpha": _get(block, "alpha", 32),
        "dropout": float(_get(block, "dropout", 0.0) or 0.0),
        "a_init": _A_INITS.get(str(_get(block, "lora_A_init_method", "xavier")), "kaiming"),
        "share_a": kind == "lora",
    }
    known = MEGATRON_LORA_TARGETS.get(kind, {})
    targets = _get(block, "target_modules", None)
    if targets:
        names: list[str] = []
        for name in targets:
            if name in known:
                names += known[name]
                continue
            other = next((k for k, names in MEGATRON_LORA_TARGETS.items() if name in names), None)
            why = f"type {other} names it, not type {kind}" if other else "unknown module"
            refusals.add(
                "model",
                "lora.target_modules",
                list(targets),
                f"{name!r}: {why}; type {kind} takes {', '.join(known)}",
            )
        lora["target_modules"] = names
    return lora


def replay_mode(engine_config: Any, refusals: Refusals | None = None) -> str:
    """verl's ``router_replay.mode``: ``disabled``, ``R2`` (the actor's old-log-prob pass records
    the routes its updates replay) or ``R3`` (the rollout's routes, replayed in every pass).
    Another is refused (into ``refusals``, else at once) and read as ``disabled``."""
    mode = str(_get(_get(engine_config, "router_replay", None) or {}, "mode", "disabled"))
    if mode not in ("disabled", "R2", "R3"):
        alone = Refusals() if refusals is None else refusals
        alone.add("engine", "router_replay.mode", mode, "disabled, R2 or R3")
        if refusals is None:
            alone.raise_any()
        return "disabled"
    return mode


_ABSENT = object()


class Fields(Mapping[str, Any]):
    """A verl config object (a dataclass, a DictConfig or a dict) as the mapping of its fields
    a backend's translation reads (a nested dataclass reads the same way)."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getitem__(self, name: str) -> Any:
        value = _get(self._config, name, _ABSENT)
        if value is _ABSENT:
            raise KeyError(name)
        nested = dataclasses.is_dataclass(value) and not isinstance(value, type)
        return Fields(value) if nested else value

    def __iter__(self) -> Iterator[str]:
        if isinstance(self._config, Mapping):
            return iter(self._config)
        if dataclasses.is_dataclass(self._config):
            return (field.name for field in dataclasses.fields(self._config))
        return iter(vars(self._config))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@runtime_checkable
class VerlTranslation(Protocol):
    """What a backend (its class) owns of verl's settings: where the compute dtype is set,
    and its options from verl's model and engine config fields and its optimizer settings,
    refusing what it cannot honour (``MegatronBackend``, ``Fsdp2Backend``)."""

    def verl_compute_dtype(self, engine: Mapping[str, Any]) -> tuple[str, Any]: ...

    def options_from_verl(
        self,
        model: Mapping[str, Any],
        engine: Mapping[str, Any],
        optimizer_settings: Sequence[tuple[str, str, Any]],
        world_size: int,
        refuse: Refuse,
    ) -> dict[str, Any]: ...


def verl_translation(backend: str) -> VerlTranslation:
    """The registered ``backend``'s class, which translates verl's settings for itself."""
    translation = registry.BACKENDS.get(backend)
    if not isinstance(translation, VerlTranslation):
        raise ConfigError(f"the {backend} backend does not translate verl's settings")
    return translation


def head_and_backend(model_type: str, strategy: str) -> tuple[str, str]:
    """This project's head and backend names for verl's model type and strategy."""
    if model_type not in HEADS:
        raise ConfigError(
            f"verl model_type {model_type!r} is not supported; supported: {', '.join(HEADS)}"
        )
    if strategy not in BACKENDS:
        raise ConfigError(
            f"verl strategy {strategy!r} is not supported by the composable engine; "
            f"supported: {', '.join(BACKENDS)}"
        )
    return HEADS[model_type], BACKENDS[strategy]


def compute_dtype(engine_config: Any, backend: VerlTranslation, refusals: Refusals) -> str:
    """The engine's compute dtype, from the verl setting ``backend`` reads it from."""
    setting, value = backend.verl_compute_dtype(Fields(engine_config))
    if str(value) not in DTYPE_NAMES:
        refusals.add("engine", setting, value, "float32 or bfloat16")
        return "float32"
    return DTYPE_NAMES[str(value)]


def _parallel(engine_config: Any) -> dict[str, Any]:
    tp = _get(engine_config, "tensor_model_parallel_size", 1)
    return {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": _get(engine_config, "pipeline_model_parallel_size", 1),
        "virtual_pipeline_parallel_size": _get(
            engine_config, "virtual_pipeline_model_parallel_size", None
        ),
        "context_parallel_size": _get(engine_config, "context_parallel_size", 1),
        "expert_parallel_size": _get(engine_config, "expert_model_parallel_size", 1),
        "sequence_parallel": bool(_get(engine_config, "sequence_parallel", False)) and tp > 1,
    }


def packed(config: EngineConfig, backend: Any, options: Mapping[str, Any]) -> EngineConfig:
    """``config`` (verl's ``use_remove_padding``, its default: each micro-batch's sequences as
    one packed row, as verl's engines run them) where the backend with ``options`` packs at its
    layout, else with padded micro-batches, which give the same numbers (e.g. megatron's
    context parallelism packs on its local layer spec, not on TransformerEngine's); the backend
    is asked (``check_packing``)."""
    if not config.packing:
        return config
    built = backend(**options)
    try:
        require(built, Packing).check_packing(config)
    except ConfigError:
        return config.replace(packing=False)
    return config


def optimizer_settings(optimizer_config: Any) -> list[tuple[str, str, Any]]:
    """verl's settings for a backend's own optimizer, each as (verl's setting, key, value):
    ``override_optimizer_config``'s entries and ``use_precision_aware_optimizer``."""
    given = dict(_get(optimizer_config, "override_optimizer_config", None) or {})
    entries = [(f"override_optimizer_config.{key}", key, value) for key, value in given.items()]
    if _get(optimizer_config, "use_precision_aware_optimizer", False):
        name = "use_precision_aware_optimizer"
        entries.append((name, name, True))
    return entries


def _optimizer_and_schedule(
    optimizer_config: Any, refusals: Refusals
) -> tuple[dict[str, Any], dict[str, Any], int]:
    if optimizer_config is None:
        return {}, {}, 1000
    lr = float(_get(optimizer_config, "lr", 1e-3))
    betas = _get(optimizer_config, "betas", (0.9, 0.999))
    clip = _get(optimizer_config, "grad_clip", None)
    clip = _get(optimizer_config, "clip_grad", 1.0) if clip is None else clip
    min_lr = _get(optimizer_config, "min_lr", None)
    ratio = _get(optimizer_config, "min_lr_ratio", None)
    if min_lr is None:
        min_lr = lr * float(ratio) if ratio is not None else 0.0
    optimizer = {
        "lr": lr,
        "min_lr": float(min_lr),
        "weight_decay": float(_get(optimizer_config, "weight_decay", 0.01)),
        "adam_beta1": float(betas[0]),
        "adam_beta2": float(betas[1]),
        "adam_eps": float(_get(optimizer_config, "eps", 1e-8)),
        "clip_grad": float(clip),
    }
    total = int(_get(optimizer_config, "total_training_steps", -1) or -1)
    total_steps = total if total > 0 else 1000
    warmup = _get(optimizer_config, "lr_warmup_steps", -1)
    if warmup is None or warmup < 0:
        warmup = int(float(_get(optimizer_config, "lr_warmup_steps_ratio", 0.0)) * max(total, 0))
    style = (
        _get(optimizer_config, "warmup_style", None)
        or _get(optimizer_config, "lr_decay_style", None)
        or _get(optimizer_config, "lr_scheduler_type", "constant")
    )
    if style not in _SCHEDULES:
        refusals.add("optimizer", "lr_scheduler_type", style, ", ".join(_SCHEDULES))
    schedule: dict[str, Any] = {
        "warmup_steps": int(warmup),
        "decay_style": _SCHEDULES.get(style, "constant"),
    }
    decay_steps = _get(optimizer_config, "lr_decay_steps", None)
    if decay_steps:
        schedule["decay_steps"] = int(decay_steps)
    return optimizer, schedule, total_steps


#: ``model.override_config`` keys that change the model, applied to its config.json before the
#: engine reads it (and checked as config.json fields are).
MODEL_OVERRIDES = ("max_position_embeddings", "rope_scaling", "rope_theta", "rope_parameters")
#: Keys that choose only how verl's own engines compute (this engine picks its own attention).
IGNORED_OVERRIDES = ("attn_implementation",)


def model_overrides(model_config: Any, refusals: Refusals) -> dict[str, Any]:
    """verl's ``model.override_config`` entries the engine applies; any other key is refused by
    name."""
    overrides = dict(_get(model_config, "override_config", None) or {})
    applied = {}
    for key, value in overrides.items():
        if key in MODEL_OVERRIDES:
            applied[key] = dict(value) if isinstance(value, Mapping) else value
        elif key not in IGNORED_OVERRIDES:
            refusals.add(
                "model",
                f"override_config.{key}",
                value,
                f"not read by this engine (it applies {', '.join(MODEL_OVERRIDES)}; "
                f"{', '.join(IGNORED_OVERRIDES)} picks verl's kernels and is ignored)",
            )
    return applied


def engine_config_from_verl(
    *,
    model_config: Any,
    engine_config: Any,
    optimizer_config: Any,
    checkpoint_config: Any,
    world_size: int,
) -> tuple[str, str, EngineConfig]:
    """``(head, backend, EngineConfig)`` for verl's config objects (``HFModelConfig``, an
    ``EngineConfig`` subclass, an ``OptimizerConfig`` subclass, ``CheckpointConfig``); every
    setting that cannot be honoured is named in one ConfigError."""
    model_type = _get(model_config, "model_type", "language_model")
    head, backend = head_and_backend(model_type, _get(engine_config, "strategy"))
    refusals = Refusals()
    refuse_unsupported(
        refusals,
        model=model_config,
        engine=engine_config,
        optimizer=optimizer_config,
        checkpoint=checkpoint_config,
    )
    path = _get(model_config, "local_path", None) or _get(model_config, "path")
    overrides = model_overrides(model_config, refusals)
    optimizer, schedule, total_steps = _optimizer_and_schedule(optimizer_config, refusals)
    translation = verl_translation(backend)
    dtype = compute_dtype(engine_config, translation, refusals)
    options = translation.options_from_verl(
        Fields(model_config),
        Fields(engine_config),
        optimizer_settings(optimizer_config),
        world_size,
        refusals.add,
    )
    lora = lora_from_verl(model_config, refusals)
    replay = replay_mode(engine_config, refusals) != "disabled"
    refusals.raise_any()
    dynamic = bool(_get(engine_config, "use_dynamic_bsz", False))
    budget = _get(engine_config, "max_token_len_per_gpu", None)
    parallel = _parallel(engine_config)
    model: Any = str(path)
    if overrides:
        from strategies.hf.config_json import model_config_from_hf

        model = model_config_from_hf(str(path), overrides)
    config = EngineConfig.from_dict(
        {
            "model": model,
            "parallel": parallel,
            "packing": bool(_get(model_config, "use_remove_padding", False)),
            "optimizer": optimizer,
            "scheduler": schedule,
            "micro_batch_size": int(_get(engine_config, "micro_batch_size_per_gpu", None) or 1),
            "max_tokens_per_micro_batch": int(budget) if dynamic and budget else None,
            "forward_only": bool(_get(engine_config, "forward_only", False)),
            "seed": int(_get(engine_config, "seed", 42)),
            "dtype": dtype,
            "total_steps": total_steps,
            "backend": options,
            "lora": lora,
            "router_replay": replay,
        }
    )
    return head, backend, packed(config, translation, options)
