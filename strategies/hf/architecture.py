"""A transformers config for a ModelConfig: the Hugging Face architecture that computes what the
model description says (Llama; Qwen2 for query/key/value biases; Qwen3 for q/k norms), or the
checkpoint's own config when the model comes from one."""

from __future__ import annotations

import inspect
from typing import Any

from heads.errors import ConfigError
from strategies.config import ModelConfig
from strategies.hf.config import load_hf_config

#: The llama3 RoPE scaling megatron implements (``strategies.hf.config`` accepts only these).
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
    if model.add_qkv_bias:
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


def _rope_settings(kind: type, base: float, llama3_factor: float | None) -> dict[str, Any]:
    """RoPE settings as the installed transformers spells them (5.x: ``rope_parameters``)."""
    scaling: dict[str, Any] = {}
    if llama3_factor is not None:
        scaling = {"rope_type": "llama3", "factor": llama3_factor, **_LLAMA3_SCALING}
    if "rope_parameters" in inspect.signature(kind).parameters:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": base, **scaling}}
    return {"rope_theta": base, "rope_scaling": scaling or None}
