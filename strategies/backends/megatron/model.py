"""Build a megatron GPTModel from a ModelConfig, with the last layer the head's spec asks for."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from heads.base import OutputSpec
from heads.errors import ConfigError
from strategies.backends.megatron.attention import packed_dot_product_attention
from strategies.backends.megatron.weight_init import initialize_parameters
from strategies.hf.classification import HeadLayer
from strategies.part_configs import ParallelConfig, PartsConfig


def transformer_config(
    config: PartsConfig, overrides: Mapping[str, Any] | None = None, *, use_te: bool = False
) -> Any:
    """Megatron's TransformerConfig for a Llama-family model (RoPE, RMSNorm, SwiGLU, GQA; dense
    or mixture-of-experts), with the backend's ``transformer_overrides`` on top."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model, parallel = config.model, config.parallel
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    settings: dict[str, Any] = {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups,
        "kv_channels": model.head_dim,
        "add_qkv_bias": model.add_qkv_bias,
        "qk_layernorm": model.qk_layernorm,
        "ffn_hidden_size": model.resolved_ffn_hidden_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": model.norm_epsilon,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": model.init_method_std,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "tensor_model_parallel_size": parallel.tensor_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_parallel_size,
        "virtual_pipeline_model_parallel_size": parallel.virtual_pipeline_parallel_size,
        "context_parallel_size": parallel.context_parallel_size,
        "expert_model_parallel_size": parallel.expert_parallel_size,
        "sequence_parallel": parallel.sequence_parallel,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": config.dtype == "bfloat16",
        # Losses are normalised by global counts by the loss function itself (engine.losses):
        # megatron must neither divide them by the micro-batch count nor average over DP.
        "calculate_per_token_loss": True,
        # Batched p2p (send and receive posted together) mismatches messages on gloo in the
        # interleaved schedule (virtual pipeline stages): post them one by one there.
        "batch_p2p_comm": not (dist.is_initialized() and dist.get_backend() == "gloo"),
        "variable_seq_lengths": True,  # micro-batches are padded to their own longest sequence
        "moe_token_dispatcher_type": "alltoall",  # the only dispatcher that allows that
        # Weights are re-drawn by ``init.initialize_parameters`` (layout-independent). Megatron
        # still initialises them first, on the host: that is where it marks the tensor-parallel
        # attributes (``tensor_model_parallel``, ``partition_dim``) that grad norms rely on.
        "use_cpu_initialization": True,
        # megatron-core 0.16's default ("full") is deprecated for this one, the same scope, and
        # warns on every config built with it.
        "cuda_graph_scope": [],
    }
    settings.update(moe_settings(config, use_te))
    settings.update(overrides or {})
    try:
        return TransformerConfig(**settings)
    except (TypeError, ValueError, AssertionError) as error:
        raise ConfigError(f"megatron rejected the model config: {error}") from error


def moe_settings(config: PartsConfig, use_te: bool) -> dict[str, Any]:
    """TransformerConfig fields of a mixture-of-experts ModelConfig (none for a dense one)."""
    model = config.model
    if model.num_experts is None:
        return {}
    softmax = model.router_score_function == "softmax"
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.experts_per_token,
        "moe_ffn_hidden_size": model.resolved_expert_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": model.shared_expert_ffn_hidden_size,
        "moe_router_score_function": model.router_score_function,
        # softmax over the chosen experts' logits == softmax over all, then renormalised
        "moe_router_pre_softmax": softmax and not model.normalize_expert_weights,
        "moe_router_load_balancing_type": "aux_loss" if model.router_aux_loss_coeff else "none",
        "moe_aux_loss_coeff": model.router_aux_loss_coeff,
        "moe_z_loss_coeff": model.router_z_loss_coeff or None,
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": use_te,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
    }


#: TransformerConfig fields the engine sets from its own configs, or that decide which layer
#: spec is built: an override would be accepted by megatron and silently not honoured (or would
#: desynchronise the model from what initialisation, checkpoints and Hugging Face export assume).
#: Each maps to where to set it instead.
ENGINE_OWNED_FIELDS: dict[str, str] = {
    **{
        name: f"ModelConfig.{field}"
        for name, field in (
            ("num_layers", "num_layers"),
            ("hidden_size", "hidden_size"),
            ("num_attention_heads", "num_attention_heads"),
            ("num_query_groups", "num_query_groups"),
            ("kv_channels", "head_dim"),
            ("add_qkv_bias", "add_qkv_bias"),
            ("qk_layernorm", "qk_layernorm"),
            ("ffn_hidden_size", "ffn_hidden_size"),
            ("layernorm_epsilon", "norm_epsilon"),
            ("init_method_std", "init_method_std"),
            ("num_moe_experts", "num_experts"),
            ("moe_router_topk", "experts_per_token"),
            ("moe_ffn_hidden_size", "expert_ffn_hidden_size"),
            ("moe_shared_expert_intermediate_size", "shared_expert_ffn_hidden_size"),
            ("moe_router_score_function", "router_score_function"),
            ("moe_router_pre_softmax", "normalize_expert_weights"),
            ("moe_aux_loss_coeff", "router_aux_loss_coeff"),
            ("moe_router_load_balancing_type", "router_aux_loss_coeff"),
            ("moe_z_loss_coeff", "router_z_loss_coeff"),
        )
    },
    **{
        name: f"ParallelConfig.{field}"
        for name, field in (
            ("tensor_model_parallel_size", "tensor_parallel_size"),
            ("pipeline_model_parallel_size", "pipeline_parallel_size"),
            ("virtual_pipeline_model_parallel_size", "virtual_pipeline_parallel_size"),
            ("context_parallel_size", "context_parallel_size"),
            ("expert_model_parallel_size", "expert_parallel_size"),
            ("expert_tensor_parallel_size", "tensor_parallel_size (experts use the same)"),
            ("sequence_parallel", "sequence_parallel"),
        )
    },
    "params_dtype": "EngineConfig.dtype",
    "pipeline_dtype": "EngineConfig.dtype",
    "bf16": "EngineConfig.dtype",
    "fp16": "EngineConfig.dtype (float32 or bfloat16)",
    "calculate_per_token_loss": "the loss function (losses normalise by global token counts)",
    "variable_seq_lengths": "the engine (micro-batches have their own lengths)",
    "moe_grouped_gemm": "MegatronBackend.layer_spec (transformer_engine: grouped GEMM)",
    "moe_enable_routing_replay": "EngineConfig.router_replay",
    "normalization": "nothing: the engine builds RMSNorm models",
    "gated_linear_unit": "nothing: the engine builds SwiGLU models",
    "add_bias_linear": "nothing: the engine builds models without linear biases",
    "multi_latent_attention": "nothing: the layer spec has no multi-latent attention",
    "moe_layer_freq": "nothing: every layer of a mixture-of-experts model is one",
    "mtp_num_layers": "nothing: multi-token prediction layers are not built",
    "qk_l2_norm": "nothing: the layer spec does not build it",
    "heterogeneous_block_specs": "nothing: every layer has the same spec",
}


def check_transformer_overrides(overrides: Mapping[str, Any]) -> None:
    """Every key names a field of megatron's TransformerConfig that the backend honours
    (ConfigError naming the key, and where to set it when the engine owns it), before anything
    is built."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(
            f"MegatronBackend.transformer_overrides: {', '.join(map(repr, unknown))} "
            "is not a field of megatron's TransformerConfig"
        )
    owned = sorted(set(overrides) & set(ENGINE_OWNED_FIELDS))
    if owned:
        where = "; ".join(f"{name!r}: set {ENGINE_OWNED_FIELDS[name]}" for name in owned)
        raise ConfigError(
            f"MegatronBackend.transformer_overrides sets {', '.join(map(repr, owned))}, which "
            f"the engine derives itself (an override would not be honoured everywhere); {where}"
        )


def uses_transformer_engine(kind: str) -> bool:
    """Whether the layer spec is TransformerEngine's."""
    has_te = importlib.util.find_spec("transformer_engine") is not None
    use_te = kind == "transformer_engine" or (kind == "auto" and has_te)
    if use_te and not has_te:
        raise ConfigError("layer_spec='transformer_engine' but transformer_engine is not installed")
    return use_te


def layer_spec(
    kind: str, parallel: ParallelConfig, qk_layernorm: bool = False, num_experts: int | None = None
) -> Any:
    """The transformer layer spec: TransformerEngine's where available (grouped-GEMM experts),
    else megatron's local (sequential experts; a core attention that also runs packed
    micro-batches; under sequence parallelism, norms that take a sequence shard)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if uses_transformer_engine(kind):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=num_experts is not None,
            qk_layernorm=qk_layernorm,
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=qk_layernorm,
    )
    # The local DotProductAttention refuses packed (thd) micro-batches; this one runs both.
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = packed_dot_product_attention()
    if parallel.sequence_parallel:
        spec.submodules.input_layernorm = sequence_parallel_norm(True)
        spec.submodules.pre_mlp_layernorm = sequence_parallel_norm(True)
        if qk_layernorm:  # over each head's channels, after the column-parallel projection
            attention.q_layernorm = attention.k_layernorm = sequence_parallel_norm(False)
    return spec


def block_spec(layer: Any, config: Any, parallel: ParallelConfig, vp_stage: int | None) -> Any:
    """The decoder block of ``layer``s: under sequence parallelism on the local spec, with a
    final norm that takes a sequence shard (megatron's own block refuses it there)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if not (parallel.sequence_parallel and issubclass(layer.module, TransformerLayer)):
        return layer
    norm = layer.submodules.input_layernorm
    if norm is not sequence_parallel_norm(True):  # TransformerEngine's norms take shards
        return layer
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=norm)


@functools.cache
def sequence_parallel_norm(sequence_sharded: bool) -> type:
    """torch's RMSNorm as megatron's local spec builds it (``WrappedTorchNorm``, which refuses
    sequence parallelism). ``sequence_sharded``: it normalises this rank's shard of the
    sequence, so each rank's weight gradient is a partial sum; the weight is marked
    ``sequence_parallel`` and megatron's ``finalize_model_grads`` all-reduces it over the
    tensor-parallel group (as TransformerEngine's norms are marked). Query / key norms run on
    the whole sequence after the column-parallel projection: megatron all-reduces their
    gradients by name (each rank holds other heads)."""

    class SequenceParallelNorm:
        def __new__(  # type: ignore[misc]
            cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any
        ) -> torch.nn.Module:
            if config.normalization != "RMSNorm":
                raise ConfigError(
                    f"sequence_parallel on megatron's local spec takes RMSNorm models, not "
                    f"{config.normalization}"
                )
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
            for param in norm.parameters():
                param.sequence_parallel = sequence_sharded  # type: ignore[attr-defined]
            return norm

    return SequenceParallelNorm


class ReplicatedOutputLayer(torch.nn.Linear):
    """A ``hidden -> features`` layer identical on every tensor-parallel rank (value heads),
    with a bias where its classifier checkpoint's ``score`` layer has one.

    GPTModel calls its output layer as ``layer(x, weight=..., runtime_gather_output=...)`` and
    expects ``(output, bias)``; the layer must itself be the module (no wrapper) so that
    megatron's ``sharded_state_dict`` finds ``output_layer.weight`` (and ``.bias``). The bias
    is added here: GPTModel discards the second element.
    """

    def __init__(
        self,
        hidden_size: int,
        features: int,
        *,
        dtype: torch.dtype,
        bias: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__(hidden_size, features, bias=bias, dtype=dtype)
        self.sequence_parallel = sequence_parallel

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            # every rank computes the whole sequence's outputs and loss alike, so the gradient
            # of its own shard is its slice (not a sum over ranks, as for vocabulary shards)
            from megatron.core.tensor_parallel import mappings

            x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        return super().forward(x), None


def hand_over_hidden_states(model: torch.nn.Module) -> None:
    """Make a last-stage GPTModel chunk's vocabulary output layer return its input instead of
    the logits: the final hidden states (GPTModel hands them over as ``[b, s, hidden]``),
    entered into the tensor-parallel region as the column-parallel layer enters them (gradient
    all-reduced over the group; with sequence parallelism, gathered along the sequence and the
    gradient reduce-scattered). A fused head then applies the layer itself
    (:func:`output_weight`). The layer stays the module it was (checkpoints, export)."""
    from megatron.core.tensor_parallel import mappings

    layer: Any = model.output_layer

    def forward(
        x: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        if layer.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, group=layer.tp_group)
        elif layer.tp_group.size() > 1:
            x = mappings.copy_to_tensor_model_parallel_region(x, group=layer.tp_group)
        return _ContiguousGradient.apply(x), None

    layer.forward = forward


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose gradient is made contiguous. GPTModel hands the hidden states over
    transposed (``[s, b, h] -> [b, s, h]``), so their gradient comes back as a transposed view;
    megatron's tensor-parallel all-reduce of it (``mappings._reduce``) would all-reduce a
    contiguous copy and drop the result."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def output_weight(model: Any) -> torch.Tensor:
    """The weight a last-stage GPTModel chunk's output layer applies: the embedding's where
    tied (as GPTModel passes it), else the layer's own (this rank's vocabulary rows)."""
    if model.share_embeddings_and_output_weights:
        weight: torch.Tensor = model.shared_embedding_or_output_weight()
        return weight
    return model.output_layer.weight


def build_gpt_model(
    config: PartsConfig,
    spec: OutputSpec,
    head_layer: HeadLayer,
    layer_spec_kind: str,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> torch.nn.Module:
    """A GPTModel chunk whose output layer follows ``spec`` (a replicated one: with the bias
    ``head_layer`` says; its weights read later where the checkpoint holds them)."""
    from megatron.core.models.gpt import GPTModel

    model_config = config.model
    tie = spec.allow_tied_embeddings and model_config.tie_embeddings
    use_te = uses_transformer_engine(layer_spec_kind)
    megatron_config = transformer_config(config, overrides, use_te=use_te)
    layers = layer_spec(
        layer_spec_kind, config.parallel, model_config.qk_layernorm, model_config.num_experts
    )
    model = GPTModel(
        config=megatron_config,
        transformer_layer_spec=block_spec(layers, megatron_config, config.parallel, vp_stage),
        vocab_size=model_config.vocab_size,
        max_sequence_length=model_config.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tie,
        position_embedding_type="rope",
        rotary_base=model_config.rotary_base,
        rope_scaling=model_config.rope_scaling_factor is not None,
        rope_scaling_factor=model_config.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    if spec.kind == "replicated" and post_process:
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        model.output_layer = ReplicatedOutputLayer(
            model_config.hidden_size,
            spec.features,
            dtype=dtype,
            bias=head_layer.bias,
            sequence_parallel=config.parallel.sequence_parallel,
        )
    if spec.fused and post_process:
        hand_over_hidden_states(model)
    if model_config.hf_path is None:
        initialize_parameters(model, config)
    elif spec.kind == "replicated" and post_process and not head_layer.from_checkpoint:
        initialize_parameters(model, config, only=("output_layer.",))  # an LM's checkpoint
    return model
