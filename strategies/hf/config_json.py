"""A ModelConfig from a Hugging Face ``config.json`` (Llama, Qwen2, Qwen3, Mistral; the
mixture-of-experts Qwen3-MoE and Mixtral).

The family comes from ``model_type``, as transformers' ``AutoModelForCausalLM`` decides it;
``architectures`` is not consulted. Anything the engine would compute differently is rejected
naming the field, never silently approximated; and the checkpoint's tensors must be exactly
those of that model, a causal LM or a classifier (``...ForTokenClassification`` /
``...ForSequenceClassification``: its ``score`` layer is recorded as
``ModelConfig.checkpoint_labels`` and ``head_bias``)
(:func:`strategies.hf.consistency.check_checkpoint_tensors`), so a file that does not match its
config is refused before any compute.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from heads.errors import CheckpointError, ConfigError
from strategies.part_configs import ModelConfig

#: What megatron's llama3 RoPE scaling hard-codes (``RotaryEmbedding._apply_scaling``).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


def load_hf_config(path: str | os.PathLike[str]) -> Any:
    """transformers' config object for the checkpoint directory ``path`` (local files only)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path} is not a Hugging Face checkpoint: it has no config.json")
    try:
        return AutoConfig.from_pretrained(os.fspath(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"cannot read {path}/config.json: {error}") from error


def apply_overrides(hf: Any, overrides: Mapping[str, Any]) -> Any:
    """transformers' config ``hf`` with ``overrides`` replacing its fields (``rope_scaling`` /
    ``rope_theta`` also in ``rope_parameters``, where transformers 5.x reads them)."""
    for key, value in overrides.items():
        rope = getattr(hf, "rope_parameters", None)
        if key in ("rope_scaling", "rope_theta") and rope:
            hf.rope_parameters = {
                **rope,
                **(dict(value) if key == "rope_scaling" else {key: value}),
            }
        setattr(hf, key, value)
    return hf


def model_config_from_hf(
    path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None
) -> ModelConfig:
    """The ModelConfig of the checkpoint at ``path``, with ``hf_path`` set to load its weights;
    its tensors are checked against the model its config describes. ``overrides`` replace
    config.json fields first (as transformers' ``from_pretrained(**kwargs)`` and verl's
    ``override_config`` do), then go through the same checks."""
    from strategies.hf.consistency import check_checkpoint_tensors

    hf = apply_overrides(load_hf_config(path), overrides or {})
    family = getattr(hf, "model_type", None)
    if family not in _FAMILY_CHECKS:
        raise ConfigError(
            f"config.json model_type={family!r} is not supported; supported: "
            f"{', '.join(sorted(_FAMILY_CHECKS))}"
        )
    _FAMILY_CHECKS[family](hf)
    _require(hf, "hidden_act", "silu")
    if getattr(hf, "mlp_bias", False):
        raise ConfigError("config.json mlp_bias=True is not supported (megatron: no MLP biases)")
    theta, factor = _rope(hf)
    heads = int(hf.num_attention_heads)
    head_dim = getattr(hf, "head_dim", None)
    experts = _EXPERT_FIELDS[family](hf) if family in _EXPERT_FIELDS else {}
    config = ModelConfig(
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        num_layers=int(hf.num_hidden_layers),
        num_attention_heads=heads,
        num_query_groups=int(getattr(hf, "num_key_value_heads", None) or heads),
        ffn_hidden_size=int(hf.intermediate_size),
        max_sequence_length=int(hf.max_position_embeddings),
        rotary_base=theta,
        norm_epsilon=float(hf.rms_norm_eps),
        init_method_std=float(getattr(hf, "initializer_range", 0.02)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        add_qkv_bias=family == "qwen2",
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        head_dim=int(head_dim) if head_dim and head_dim * heads != hf.hidden_size else None,
        rope_scaling_factor=factor,
        hf_path=os.fspath(path),
        checkpoint_dtype=_dtype_name(hf),
        **experts,
    )
    score = check_checkpoint_tensors(os.fspath(path), hf)
    if score is None:
        return config
    return attrs.evolve(config, checkpoint_labels=score.labels, head_bias=score.bias)


def _require(hf: Any, field: str, wanted: object) -> None:
    value = getattr(hf, field, wanted)
    if value != wanted:
        raise ConfigError(f"config.json {field}={value!r} is not supported; only {wanted!r}")


def _no_attention_bias(hf: Any) -> None:
    if getattr(hf, "attention_bias", False):
        raise ConfigError(
            "config.json attention_bias=True is not supported (it adds an output-projection "
            "bias megatron's add_qkv_bias does not have)"
        )


def _full_attention(hf: Any) -> None:
    """Sliding-window attention is refused unless the window covers every position."""
    window = getattr(hf, "sliding_window", None)
    uses_window = getattr(hf, "use_sliding_window", True)
    if uses_window and window is not None and window < hf.max_position_embeddings:
        raise ConfigError(
            f"config.json sliding_window={window} is smaller than max_position_embeddings "
            f"({hf.max_position_embeddings}); sliding-window attention is not supported"
        )


def _llama(hf: Any) -> None:
    _no_attention_bias(hf)


def _qwen2(hf: Any) -> None:
    _full_attention(hf)


def _qwen3(hf: Any) -> None:
    _no_attention_bias(hf)
    _full_attention(hf)


def _mistral(hf: Any) -> None:
    _full_attention(hf)


def _no_shared_experts(hf: Any) -> None:
    for field in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if getattr(hf, field, None):
            raise ConfigError(
                f"config.json {field}={getattr(hf, field)!r}: shared experts are not supported "
                "for Hugging Face checkpoints"
            )


def _qwen3_moe(hf: Any) -> None:
    """Every layer sparse (megatron builds no dense MLP layers between MoE ones)."""
    _qwen3(hf)
    _no_shared_experts(hf)
    if getattr(hf, "mlp_only_layers", None):
        raise ConfigError(
            f"config.json mlp_only_layers={list(hf.mlp_only_layers)!r} is not supported: every "
            "layer must be a mixture of experts"
        )
    _require(hf, "decoder_sparse_step", 1)


def _mixtral(hf: Any) -> None:
    _full_attention(hf)
    _no_shared_experts(hf)
    if getattr(hf, "router_jitter_noise", 0.0):
        raise ConfigError(
            f"config.json router_jitter_noise={hf.router_jitter_noise!r} is not supported (it "
            "scales training inputs by random noise megatron does not draw); only 0"
        )


_FAMILY_CHECKS: dict[str, Callable[[Any], None]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}


def _router_aux_loss(hf: Any) -> float:
    """``router_aux_loss_coef`` only when ``output_router_logits`` is true: transformers adds
    the load-balancing loss to the LM loss only then, so a checkpoint that leaves it false
    (Qwen3-MoE's and Mixtral's releases) trains without it, and so does the engine."""
    if not getattr(hf, "output_router_logits", False):
        return 0.0
    return float(getattr(hf, "router_aux_loss_coef", 0.0))


def _qwen3_moe_experts(hf: Any) -> dict[str, Any]:
    return {
        "num_experts": int(hf.num_experts),
        "experts_per_token": int(hf.num_experts_per_tok),
        "expert_ffn_hidden_size": int(hf.moe_intermediate_size),
        "normalize_expert_weights": bool(getattr(hf, "norm_topk_prob", False)),
        "router_aux_loss_coeff": _router_aux_loss(hf),
    }


def _mixtral_experts(hf: Any) -> dict[str, Any]:
    """Mixtral's experts are its only MLPs (``intermediate_size``); top-k scores are always
    renormalised."""
    return {
        "num_experts": int(hf.num_local_experts),
        "experts_per_token": int(hf.num_experts_per_tok),
        "expert_ffn_hidden_size": int(hf.intermediate_size),
        "normalize_expert_weights": True,
        "router_aux_loss_coeff": _router_aux_loss(hf),
    }


#: ModelConfig expert fields of the mixture-of-experts families (softmax routing in both).
_EXPERT_FIELDS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe_experts,
    "mixtral": _mixtral_experts,
}

#: Weight dtypes a checkpoint may state (``dtype`` in transformers 5.x, ``torch_dtype`` before).
_DTYPES = ("float32", "bfloat16", "float16")


def _dtype_name(hf: Any) -> str | None:
    """The dtype config.json states for the weights (exports use it), or None."""
    stated = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if stated is None:
        return None
    name = str(stated).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"config.json dtype={stated!r} is not supported; supported: {_DTYPES}")
    return name


def _rope(hf: Any) -> tuple[int, float | None]:
    """(rotary base, llama3 scaling factor or None) from transformers 4.x or 5.x fields."""
    parameters: Mapping[str, Any] | None = getattr(hf, "rope_parameters", None)
    if parameters:  # transformers 5.x
        scaling, field = dict(parameters), "rope_parameters"
        theta = scaling.get("rope_theta", getattr(hf, "rope_theta", None))
    else:  # transformers 4.x
        scaling, field = dict(getattr(hf, "rope_scaling", None) or {}), "rope_scaling"
        theta = getattr(hf, "rope_theta", 10000.0)
    if theta is None or float(theta) != int(theta):
        raise ConfigError(f"config.json rope_theta={theta!r} must be a whole number")
    partial = getattr(hf, "partial_rotary_factor", None) or scaling.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"config.json partial_rotary_factor={partial!r} is not supported")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return int(theta), None
    if rope_type != "llama3":
        raise ConfigError(
            f"config.json {field}.rope_type={rope_type!r} is not supported; supported: "
            "'default', 'llama3'"
        )
    for name, wanted in (
        *_LLAMA3_FIXED.items(),
        ("original_max_position_embeddings", _LLAMA3_ORIGINAL_MAX_POSITIONS),
    ):
        if float(scaling.get(name, float("nan"))) != wanted:
            raise ConfigError(
                f"config.json {field}.{name}={scaling.get(name)!r} is not supported: megatron's "
                f"llama3 RoPE scaling fixes it to {wanted:g}"
            )
    return int(theta), float(scaling["factor"])
