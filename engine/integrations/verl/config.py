"""verl's config objects -> this project's ``EngineConfig`` (no verl import: read by attribute).

Every verl setting is either translated, or harmless to ignore because it only chooses how
verl's own engines compute (kernels, compilation, wrapping), or refused by name with
``ConfigError`` when this engine cannot honour it. ``use_fused_kernels`` (model, engine and the
batch flag) is one to ignore: it picks verl's fused LM-head kernels; this engine's LM head
computes log-probs and entropy from the hidden states and output weight either way (its
``fused`` option, on by default), the same numbers whatever verl asks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine.config import EngineConfig
from engine.integrations.verl.cells import BACKENDS, HEADS
from heads.errors import ConfigError
from strategies.config import LoraConfig


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
    ("model", "override_config", _no_mapping_entries, "config.json is read as it is"),
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
    ("engine", "ulysses_sequence_parallel_size", lambda v: v == 1, "no Ulysses parallelism"),
    ("engine", "offload_policy", _off, "use param_offload / optimizer_offload"),
    ("engine", "model_dtype", lambda v: v in ("fp32", "float32"), "weights are kept in fp32"),
    ("engine", "expert_tensor_parallel_size", lambda v: v in (None, 1), "no expert TP"),
    ("engine", "dynamic_context_parallel", _off, "no dynamic context parallelism"),
    ("engine", "use_dist_checkpointing", _off, "checkpoints are this engine's own"),
    ("engine", "use_megatron_fsdp", _off, "use the fsdp2 backend"),
    ("engine", "override_ddp_config", _no_mapping_entries, "not configurable here"),
    ("engine", "override_mcore_model_config", _no_mapping_entries, "not configurable here"),
    ("optimizer", "override_optimizer_config", _no_mapping_entries, "not configurable here"),
    ("optimizer", "optimizer", lambda v: str(v).lower() in ("adamw", "adam"), "AdamW only"),
    ("optimizer", "optimizer_impl", lambda v: v == "torch.optim", "torch.optim.AdamW only"),
    ("optimizer", "num_cycles", lambda v: v == 0.5, "a half-cosine only"),
    ("optimizer", "lr_warmup_init", lambda v: not v, "warmup starts from 0"),
    ("optimizer", "weight_decay_incr_style", lambda v: v == "constant", "constant decay only"),
    ("optimizer", "use_precision_aware_optimizer", _off, "not supported"),
    ("checkpoint", "async_save", _off, "use a backend with async checkpoints directly"),
]

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
_SCHEDULES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}


def refuse_unsupported(**configs: Any) -> None:
    """ConfigError naming the first setting in ``configs`` (kind -> object) we cannot honour."""
    for kind, name, accepted, hint in REFUSED:
        obj = configs.get(kind)
        if obj is not None:
            _refuse_fields(kind, obj, [(name, accepted, hint)])


def _refusal(kind: str, setting: str, value: Any, hint: str) -> ConfigError:
    return ConfigError(
        f"verl {kind} setting {setting}={value!r} is not supported by the composable engine: {hint}"
    )


def _refuse_fields(
    kind: str,
    obj: Any,
    checks: list[tuple[str, Callable[[Any], bool], str]],
    prefix: str = "",
) -> None:
    """The first field of ``obj`` that ``checks`` (name, accepted?, hint) does not accept, as a
    ConfigError naming ``prefix`` + its name; a field absent from ``obj`` is fine."""
    sentinel = object()
    for name, accepted, hint in checks:
        value = _get(obj, name, sentinel)
        if value is not sentinel and not accepted(value):
            raise _refusal(kind, prefix + name, value, hint)


#: verl's megatron LoRA module names (``model.lora.target_modules``) -> Hugging Face names: one
#: adapter per projection (verl's ``type: canonical_lora``; ``type: lora`` for the unfused ones).
MEGATRON_LORA_TARGETS = {
    "linear_q": "q_proj",
    "linear_k": "k_proj",
    "linear_v": "v_proj",
    "linear_proj": "o_proj",
    "linear_fc1_gate": "gate_proj",
    "linear_fc1_up": "up_proj",
    "linear_fc2": "down_proj",
}
#: verl's megatron ``type: lora`` fuses these: one adapter (a shared ``A``) over q/k/v or gate/up.
_FUSED_LORA_TARGETS = {
    "linear_qkv": "linear_q, linear_k, linear_v",
    "linear_fc1": "linear_fc1_gate, linear_fc1_up",
}


def _lora_refusal(setting: str, value: Any, hint: str) -> ConfigError:
    return _refusal("model", setting, value, hint)


def lora_from_verl(model_config: Any) -> dict[str, Any] | None:
    """``EngineConfig.lora`` for verl's LoRA settings (None: no LoRA). verl has two spellings,
    either is read whatever the strategy: the flat fields its FSDP engine reads (``lora_rank``,
    ``lora_alpha``, ``target_modules``, ``exclude_modules``, ``target_parameters``) and the
    ``lora`` block its megatron engine reads (``rank``, ``alpha``, ``dropout``,
    ``target_modules``, ...). What cannot be honoured is refused naming verl's field."""
    flat_rank = int(_get(model_config, "lora_rank", 0) or 0)
    block = _get(model_config, "lora", None) or {}
    block_rank = int(_get(block, "rank", 0) or 0)
    if flat_rank > 0 and block_rank > 0:
        raise ConfigError(
            f"verl model settings lora_rank={flat_rank} and lora.rank={block_rank} are both set; "
            "the composable engine takes one (either spelling works with every strategy)"
        )
    if flat_rank > 0:
        lora = _flat_lora(model_config, flat_rank)
        settings = {"target_modules": "target_modules", "alpha": "lora_alpha"}
    elif block_rank > 0:
        lora = _block_lora(block, block_rank)
        settings = {field: f"lora.{field}" for field in ("target_modules", "alpha", "dropout")}
    else:
        return None
    try:
        LoraConfig(**lora)
    except ConfigError as error:
        field = next((field for field in settings if field in str(error)), "target_modules")
        raise _lora_refusal(settings[field], lora.get(field), str(error)) from error
    return lora


def _flat_lora(model_config: Any, rank: int) -> dict[str, Any]:
    """verl's FSDP spelling, which builds a peft ``LoraConfig`` (no dropout: peft's 0)."""
    for name in ("exclude_modules", "target_parameters"):
        value = _get(model_config, name, None)
        if value:
            raise _lora_refusal(name, value, "adapters go on whole target linears only")
    lora: dict[str, Any] = {"rank": rank, "alpha": _get(model_config, "lora_alpha", 16)}
    targets = _get(model_config, "target_modules", "all-linear")
    if isinstance(targets, str):
        if targets != "all-linear":
            raise _lora_refusal(
                "target_modules", targets, "'all-linear' or a list of module names (no regex)"
            )
    elif targets is not None:
        lora["target_modules"] = [str(name) for name in targets]
    return lora


def _block_lora(block: Any, rank: int) -> dict[str, Any]:
    """verl's megatron spelling (Megatron-Bridge's LoRA settings)."""
    kind = _get(block, "type", "lora")
    if kind not in ("lora", "canonical_lora"):
        raise _lora_refusal("lora.type", kind, "plain LoRA only (lora or canonical_lora)")
    checks: list[tuple[str, Callable[[Any], bool], str]] = [
        ("exclude_modules", lambda v: not v, "name the targets in lora.target_modules"),
        ("dropout_position", lambda v: v == "pre", "dropout is on the adapter's input ('pre')"),
        (
            "lora_A_init_method",
            lambda v: v != "xavier",
            "A is drawn Kaiming-uniform as peft does (lora_A_init_method=kaiming)",
        ),
        ("lora_B_init_method", lambda v: v == "zero", "B starts at zero"),
        ("a2a_experimental", lambda v: not v, "not supported"),
        ("dtype", lambda v: v is None, "adapters are kept in the weights' dtype"),
        (
            "adapter_path",
            lambda v: v is None,
            "an existing adapter is not loaded (give a model with it merged as model.path)",
        ),
    ]
    _refuse_fields("model", block, checks, prefix="lora.")
    lora: dict[str, Any] = {
        "rank": rank,
        "alpha": _get(block, "alpha", 32),
        "dropout": float(_get(block, "dropout", 0.0) or 0.0),
    }
    targets = _get(block, "target_modules", None)
    if targets:
        names = []
        for name in targets:
            if kind == "lora" and name in _FUSED_LORA_TARGETS:
                raise _lora_refusal(
                    "lora.target_modules",
                    list(targets),
                    f"type lora puts one adapter on the fused {name} (an A shared by its "
                    "projections), which is not built here; type canonical_lora with "
                    f"{_FUSED_LORA_TARGETS[name]} gives one adapter per projection",
                )
            if name not in MEGATRON_LORA_TARGETS:
                raise _lora_refusal(
                    "lora.target_modules",
                    list(targets),
                    f"unknown module {name!r}; known: {', '.join(MEGATRON_LORA_TARGETS)}",
                )
            names.append(MEGATRON_LORA_TARGETS[name])
        lora["target_modules"] = names
    return lora


def replay_mode(engine_config: Any) -> str:
    """verl's ``router_replay.mode``: ``disabled``, ``R2`` (the actor's old-log-prob pass records
    the routes its updates replay) or ``R3`` (the rollout's routes, replayed in every pass)."""
    mode = str(_get(_get(engine_config, "router_replay", None) or {}, "mode", "disabled"))
    if mode not in ("disabled", "R2", "R3"):
        raise _refusal("engine", "router_replay.mode", mode, "disabled, R2 or R3")
    return mode


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


def compute_dtype(engine_config: Any, backend: str) -> str:
    """The engine's compute dtype: FSDP's ``mixed_precision.param_dtype`` (verl's default bf16)
    for fsdp2, the engine config's ``dtype`` otherwise."""
    if backend == "fsdp2" and _get(engine_config, "mixed_precision", None) is not None:
        value = _get(_get(engine_config, "mixed_precision"), "param_dtype", "bf16")
        setting = "mixed_precision.param_dtype"
    elif backend == "fsdp2" and _get(engine_config, "model_dtype", None) is not None:
        value, setting = "bf16", "mixed_precision.param_dtype"  # verl's FSDP default
    else:
        value, setting = _get(engine_config, "dtype", "bfloat16"), "dtype"
    if str(value) not in _DTYPES:
        raise ConfigError(
            f"verl engine setting {setting}={value!r} is not supported by the composable engine: "
            "float32 or bfloat16"
        )
    return _DTYPES[str(value)]


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


def _backend_options(
    backend: str, model_config: Any, engine_config: Any, world_size: int
) -> dict[str, Any]:
    checkpointing = bool(_get(model_config, "enable_gradient_checkpointing", False))
    if backend == "fsdp2":
        options: dict[str, Any] = {
            "activation_checkpointing": checkpointing,
            "reshard_after_forward": bool(_get(engine_config, "reshard_after_forward", True)),
        }
        fsdp_size = _get(engine_config, "fsdp_size", -1)
        if fsdp_size not in (-1, None, world_size):
            if fsdp_size <= 0 or world_size % fsdp_size:
                raise ConfigError(
                    f"verl engine setting fsdp_size={fsdp_size} must divide the world size "
                    f"({world_size})"
                )
            options["replicate_size"] = world_size // fsdp_size
        return options
    overrides = dict(_get(engine_config, "override_transformer_config", None) or {})
    if checkpointing:
        overrides.setdefault("recompute_granularity", "full")
        overrides.setdefault("recompute_method", "uniform")
        overrides.setdefault("recompute_num_layers", 1)
    return {
        "use_distributed_optimizer": bool(_get(engine_config, "use_distributed_optimizer", False)),
        "transformer_overrides": overrides,
    }


def _optimizer_and_schedule(optimizer_config: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
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
        raise ConfigError(
            f"verl optimizer setting lr_scheduler_type={style!r} is not supported by the "
            f"composable engine: {', '.join(_SCHEDULES)}"
        )
    schedule: dict[str, Any] = {"warmup_steps": int(warmup), "decay_style": _SCHEDULES[style]}
    decay_steps = _get(optimizer_config, "lr_decay_steps", None)
    if decay_steps:
        schedule["decay_steps"] = int(decay_steps)
    return optimizer, schedule, total_steps


def engine_config_from_verl(
    *,
    model_config: Any,
    engine_config: Any,
    optimizer_config: Any,
    checkpoint_config: Any,
    world_size: int,
) -> tuple[str, str, EngineConfig]:
    """``(head, backend, EngineConfig)`` for verl's config objects (``HFModelConfig``, an
    ``EngineConfig`` subclass, an ``OptimizerConfig`` subclass, ``CheckpointConfig``)."""
    refuse_unsupported(
        model=model_config,
        engine=engine_config,
        optimizer=optimizer_config,
        checkpoint=checkpoint_config,
    )
    model_type = _get(model_config, "model_type", "language_model")
    head, backend = head_and_backend(model_type, _get(engine_config, "strategy"))
    path = _get(model_config, "local_path", None) or _get(model_config, "path")
    optimizer, schedule, total_steps = _optimizer_and_schedule(optimizer_config)
    dynamic = bool(_get(engine_config, "use_dynamic_bsz", False))
    budget = _get(engine_config, "max_token_len_per_gpu", None)
    config = EngineConfig.from_dict(
        {
            "model": str(path),
            "parallel": _parallel(engine_config),
            "optimizer": optimizer,
            "scheduler": schedule,
            "micro_batch_size": int(_get(engine_config, "micro_batch_size_per_gpu", None) or 1),
            "max_tokens_per_micro_batch": int(budget) if dynamic and budget else None,
            "forward_only": bool(_get(engine_config, "forward_only", False)),
            "seed": int(_get(engine_config, "seed", 42)),
            "dtype": compute_dtype(engine_config, backend),
            "total_steps": total_steps,
            "backend": _backend_options(backend, model_config, engine_config, world_size),
            "lora": lora_from_verl(model_config),
            "router_replay": replay_mode(engine_config) != "disabled",
        }
    )
    return head, backend, config
