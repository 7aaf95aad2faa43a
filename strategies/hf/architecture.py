"""A transformers config for a ModelConfig: the Hugging Face architecture that computes what the
model description says (Llama; Qwen2 for query/key/value biases; Qwen3 for q/k norms; for a
mixture of experts Qwen3-MoE with q/k norms, else Mixtral), or the checkpoint's own config when
the model comes from one."""

from __future__ import annotations

import inspect
from typing import Any

from heads.errors import ConfigError
from strategies.hf.config_json import load_hf_config
from strategies.hf.experts import moe_family
from strategies.part_configs import ModelConfig

#: The llama3 RoPE scaling megatron implements (``strategies.hf.config_json`` accepts only these).
_LLAMA3_SCALING = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_config_for(model: ModelConfig) -> Any:
    """The transformers config of ``model``: its checkpoint's when ``hf_path`` is set."""
    import transformers

    if model.hf_path is not None:
        return load_hf_config(model.hf_path)
    heads = model.num_attention_heads
    head_dim = model.head_dim or model.hidden_size // heads
    settings: dict[str, Any] = {
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.resolved_ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": model.num_query_groups or heads,
        "max_position_embeddings": model.max_sequence_length,
        "rms_norm_eps": model.norm_epsilon,
        "initializer_range": model.init_method_std,
        "tie_word_embeddings": model.tie_embeddings,
        "hidden_act": "silu",
    }
    kind: type
    if model.add_qkv_bias and model.qk_layernorm:
        raise ConfigError(
            "ModelConfig.add_qkv_bias and qk_layernorm together match no Hugging Face "
            "architecture (Qwen2 has the biases, Qwen3 the norms); choose one"
        )
    if model.is_moe:
        kind, name = _moe_settings(model, settings)
    elif model.add_qkv_bias:
        if head_dim * heads != model.hidden_size:
            raise ConfigError(
                f"ModelConfig.head_dim={model.head_dim} with add_qkv_bias: Qwen2 has no head_dim "
                "setting (it is hidden_size / num_attention_heads)"
            )
        kind, name = transformers.Qwen2Config, "Qwen2ForCausalLM"
        settings.update(use_sliding_window=False, sliding_window=None)
    elif model.qk_layernorm:
        kind, name = transformers.Qwen3Config, "Qwen3ForCausalLM"
        settings.update(
            head_dim=head_dim, attention_bias=False, use_sliding_window=False, sliding_window=None
        )
    else:
        kind, name = transformers.LlamaConfig, "LlamaForCausalLM"
        settings.update(head_dim=head_dim, attention_bias=False, mlp_bias=False)
    settings.update(_rope_settings(kind, float(model.rotary_base), model.rope_scaling_factor))
    return kind(architectures=[name], **settings)


def _moe_settings(model: ModelConfig, settings: dict[str, Any]) -> tuple[type, str]:
    """Update ``settings`` for the mixture-of-experts family of ``model``: (config class, its
    causal-LM architecture name). Both families route by softmax, without shared experts."""
    import transformers

    if model.shared_expert_ffn_hidden_size is not None:
        raise ConfigError(
            "ModelConfig.shared_expert_ffn_hidden_size: no supported Hugging Face family "
            "(Qwen3-MoE, Mixtral) has a shared expert"
        )
    if model.router_score_function != "softmax":
        raise ConfigError(
            f"ModelConfig.router_score_function={model.router_score_function!r}: Qwen3-MoE and "
            "Mixtral route by softmax"
        )
    if model.add_qkv_bias:
        raise ConfigError(
            "ModelConfig.add_qkv_bias with num_experts matches no Hugging Face family "
            "(Qwen3-MoE and Mixtral have no query/key/value biases)"
        )
    head_dim = model.head_dim or model.hidden_size // model.num_attention_heads
    common = {
        "head_dim": head_dim,
        "sliding_window": None,
        "num_experts_per_tok": model.experts_per_token,
        # transformers adds the load-balancing loss only with output_router_logits
        "output_router_logits": model.router_aux_loss_coeff > 0,
        "router_aux_loss_coef": model.router_aux_loss_coeff,
    }
    settings.update(common)
    if moe_family(model) == "qwen3_moe":
        settings.update(
            num_experts=model.num_experts,
            moe_intermediate_size=model.resolved_expert_ffn_hidden_size,
            norm_topk_prob=model.normalize_expert_weights,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            attention_bias=False,
            use_sliding_window=False,
        )
        return transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM"
    if not model.normalize_expert_weights:
        raise ConfigError(
            "ModelConfig.normalize_expert_weights=False without qk_layernorm matches no Hugging "
            "Face family (Mixtral always renormalises the top-k scores; Qwen3-MoE, which may "
            "not, has q/k norms)"
        )
    settings.update(
        num_local_experts=model.num_experts,
        intermediate_size=model.resolved_expert_ffn_hidden_size,  # Mixtral's only MLPs
        router_jitter_noise=0.0,
    )
    return transformers.MixtralConfig, "MixtralForCausalLM"


def _rope_settings(kind: type, base: float, llama3_factor: float | None) -> dict[str, Any]:
    """RoPE settings as the installed transformers spells them (5.x: ``rope_parameters``)."""
    scaling: dict[str, Any] = {}
    if llama3_factor is not None:
        scaling = {"rope_type": "llama3", "factor": llama3_factor, **_LLAMA3_SCALING}
    if "rope_parameters" in inspect.signature(kind).parameters:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": base, **scaling}}
    return {"rope_theta": base, "rope_scaling": scaling or None}
