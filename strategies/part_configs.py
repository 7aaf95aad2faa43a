"""Configs the parts share: model description, parallel layout, optimizer and LR schedule.

Each is a frozen, keyword-only attrs class validated at construction, so a bad value fails with
the field name and the allowed values, never deep inside megatron.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Protocol

import attrs

from heads.errors import ConfigError
from heads.validation import (
    bool_field,
    finite,
    float_field,
    int_field,
    non_negative,
    of_type,
    one_of,
    optional_int_field,
    positive,
)


def _path_or_none(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


@attrs.frozen(kw_only=True)
class ModelConfig:
    """A decoder-only transformer (Llama family: RoPE, RMSNorm, SwiGLU, optional GQA), dense or
    mixture-of-experts (``num_experts``: every layer's MLP is a set of routed SwiGLU experts)."""

    vocab_size: int = int_field(128)
    hidden_size: int = int_field(64)
    num_layers: int = int_field(2)
    num_attention_heads: int = int_field(4)
    num_query_groups: int | None = optional_int_field()
    ffn_hidden_size: int | None = optional_int_field()
    max_sequence_length: int = int_field(256)
    rotary_base: int = int_field(10000)
    norm_epsilon: float = float_field(1e-5, positive)
    init_method_std: float = float_field(0.02, positive)
    tie_embeddings: bool = bool_field(False)
    #: Biases on the query, key and value projections (Qwen2).
    add_qkv_bias: bool = bool_field(False)
    #: RMSNorm on each head's queries and keys before RoPE (Qwen3).
    qk_layernorm: bool = bool_field(False)
    #: Per-head size when it is not ``hidden_size / num_attention_heads`` (Qwen3).
    head_dim: int | None = optional_int_field()
    #: Llama-3.x RoPE scaling factor (low/high frequency factors 1 and 4, original length 8192).
    rope_scaling_factor: float | None = attrs.field(
        default=None, validator=attrs.validators.optional([of_type((int, float)), finite, positive])
    )
    #: Mixture of experts: routed experts in every layer's MLP (None: a dense model).
    num_experts: int | None = optional_int_field()
    #: Experts each token is routed to (top-k).
    experts_per_token: int = int_field(2)
    #: Each routed expert's FFN size (default: ``ffn_hidden_size``).
    expert_ffn_hidden_size: int | None = optional_int_field()
    #: FFN size of a shared expert every token also goes through (None: no shared expert).
    shared_expert_ffn_hidden_size: int | None = optional_int_field()
    #: How router logits become scores: ``softmax`` over all experts, or ``sigmoid`` per expert.
    router_score_function: str = attrs.field(
        default="softmax", validator=one_of("softmax", "sigmoid")
    )
    #: Renormalise the chosen experts' scores to sum to 1 (Mixtral, Qwen3-MoE ``norm_topk_prob``).
    normalize_expert_weights: bool = bool_field(True)
    #: Load-balancing loss coefficient (Switch/GShard auxiliary loss, per micro-batch).
    router_aux_loss_coeff: float = float_field(0.0)
    #: Router z-loss coefficient (penalises large router logits).
    router_z_loss_coeff: float = float_field(0.0)
    #: A local Hugging Face checkpoint directory the weights are loaded from.
    hf_path: str | None = attrs.field(
        default=None,
        converter=_path_or_none,
        validator=attrs.validators.optional(of_type(str)),
    )
    #: The dtype of the Hugging Face checkpoint's weights; exported weights are cast to it.
    checkpoint_dtype: str | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(one_of("float32", "bfloat16", "float16")),
    )
    #: The Hugging Face checkpoint is a classifier (``...ForTokenClassification`` /
    #: ``...ForSequenceClassification``) with this many outputs (``num_labels``): its ``score``
    #: layer is a value or reward head's output layer. None: a causal LM's checkpoint, or none.
    checkpoint_labels: int | None = optional_int_field()
    #: A value or reward head's own output layer has a bias (set where the checkpoint's
    #: ``score`` layer has one; without it the layer and its checkpoint keys are as ever).
    head_bias: bool = bool_field(False)

    def __attrs_post_init__(self) -> None:
        if self.num_experts is not None and self.experts_per_token > self.num_experts:
            raise ConfigError(
                f"ModelConfig.experts_per_token ({self.experts_per_token}) must be <= "
                f"num_experts ({self.num_experts})"
            )
        if self.num_experts is None:
            for name in ("expert_ffn_hidden_size", "shared_expert_ffn_hidden_size"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"ModelConfig.{name} describes experts, but num_experts is None (a dense "
                        "model); set num_experts"
                    )
        groups = self.num_query_groups
        if groups is not None and self.num_attention_heads % groups:
            raise ConfigError(
                f"ModelConfig.num_query_groups must divide num_attention_heads "
                f"({self.num_attention_heads}); got {groups}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"ModelConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )

    @property
    def resolved_ffn_hidden_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def resolved_expert_ffn_hidden_size(self) -> int:
        return self.expert_ffn_hidden_size or self.resolved_ffn_hidden_size


#: Named model descriptions; ``tiny`` runs a training step in milliseconds on a laptop CPU.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        max_sequence_length=256,
    ),
    "small": ModelConfig(
        vocab_size=8192,
        hidden_size=512,
        num_layers=4,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=1408,
        max_sequence_length=1024,
    ),
}
# A tiny mixture of experts: 4 experts of FFN 64, 2 per token (about the active size of tiny).
MODEL_PRESETS["moe"] = attrs.evolve(
    MODEL_PRESETS["tiny"], num_experts=4, experts_per_token=2, expert_ffn_hidden_size=64
)


def model_preset(name: str) -> ModelConfig:
    """The preset ``name``, or a ConfigError: for a name that looks like a path, that there is
    no such directory; otherwise the closest preset and the known ones."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        pass
    if os.sep in name or name.startswith((".", "~")) or (os.altsep and os.altsep in name):
        raise ConfigError(
            f"model {name!r}: no such directory (a model is a preset name, "
            f"{', '.join(sorted(MODEL_PRESETS))}, or a Hugging Face checkpoint directory)"
        )
    close = difflib.get_close_matches(name, MODEL_PRESETS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"unknown model preset {name!r}{hint}; known presets: {', '.join(sorted(MODEL_PRESETS))}, "
        "or give a Hugging Face checkpoint directory"
    )


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """Model-parallel layout; data parallel size is whatever the world size leaves."""

    tensor_parallel_size: int = int_field(1)
    pipeline_parallel_size: int = int_field(1)
    virtual_pipeline_parallel_size: int | None = optional_int_field()
    context_parallel_size: int = int_field(1)
    expert_parallel_size: int = int_field(1)
    sequence_parallel: bool = bool_field(False)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """AdamW with decoupled weight decay and global-norm gradient clipping."""

    lr: float = float_field(1e-4, positive)
    min_lr: float = float_field(0.0)
    weight_decay: float = float_field(0.01)
    adam_beta1: float = float_field(0.9)
    adam_beta2: float = float_field(0.999)
    adam_eps: float = float_field(1e-8, positive)
    clip_grad: float = float_field(1.0)

    def __attrs_post_init__(self) -> None:
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(
                    f"OptimizerConfig.{name} must be in [0, 1); got {getattr(self, name)}"
                )
        if self.min_lr > self.lr:
            raise ConfigError(f"OptimizerConfig.min_lr ({self.min_lr}) must be <= lr ({self.lr})")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Linear warmup, then constant, linear or cosine decay to ``OptimizerConfig.min_lr``."""

    warmup_steps: int = int_field(0, non_negative)
    decay_style: str = attrs.field(
        default="constant", validator=one_of("constant", "linear", "cosine")
    )
    #: Steps over which the LR decays (warmup included); None = the configured training steps.
    decay_steps: int | None = optional_int_field()

    def resolved_decay_steps(self, total_steps: int) -> int:
        """The steps the LR decays over: ``decay_steps``, else the training's ``total_steps``
        (at least one past the warmup). Every backend's schedule uses it."""
        return self.decay_steps or max(total_steps, self.warmup_steps + 1)

    def __attrs_post_init__(self) -> None:
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"SchedulerConfig.decay_steps ({self.decay_steps}) must be > warmup_steps "
                f"({self.warmup_steps})"
            )


#: dtype names, short (``bf16``, ``fp32``) or long, -> the engine's (``EngineConfig.dtype``, a
#: backend's weights dtype).
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}

#: LoRA targets by their Hugging Face module names, in the order adapters are listed.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_targets(value: Any) -> Any:
    """Short names (``q``, ``gate``) become Hugging Face ones; canonical order, no repeats."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"LoraConfig.target_modules must be a list of module names "
            f"({', '.join(LORA_TARGETS)}); got {value!r}"
        )
    names = set()
    for name in value:
        full = f"{name}_proj" if isinstance(name, str) and not name.endswith("_proj") else name
        if full not in LORA_TARGETS:
            raise ConfigError(
                f"LoraConfig.target_modules: unknown module {name!r}; known: "
                f"{', '.join(LORA_TARGETS)} (or q, k, v, o, gate, up, down)"
            )
        names.add(full)
    if not names:
        raise ConfigError("LoraConfig.target_modules must name at least one module")
    return tuple(name for name in LORA_TARGETS if name in names)


@attrs.frozen(kw_only=True)
class LoraConfig:
    """Low-rank adapters (LoRA, as peft does it): each target linear ``W`` computes
    ``W x + (alpha / rank) * B A dropout(x)``; only ``A`` and ``B`` train. ``A`` is drawn from
    (seed, name), like peft's by default, ``B`` starts at 0."""

    rank: int = int_field(8)
    #: The scale is ``alpha / rank`` (peft's ``lora_alpha``); None: ``alpha = rank`` (scale 1).
    alpha: float | None = attrs.field(
        default=None, validator=attrs.validators.optional([of_type((int, float)), finite, positive])
    )
    dropout: float = float_field(0.0)
    #: Hugging Face names of the linears that get adapters (default: all seven).
    target_modules: tuple[str, ...] = attrs.field(default=LORA_TARGETS, converter=_lora_targets)
    #: How ``A`` is drawn: ``kaiming`` (peft's: uniform in ``+-1/sqrt(in_features)``) or
    #: ``xavier`` (Megatron-Bridge's option: uniform in ``+-sqrt(6 / (in_features + rank))``).
    a_init: str = attrs.field(default="kaiming", validator=one_of("kaiming", "xavier"))
    #: The targets one fused linear computes (q/k/v; gate/up) share one ``A``, each keeping its
    #: own ``B``: one adapter per fused linear, as Megatron-Bridge's ``lora`` type puts on
    #: ``linear_qkv`` / ``linear_fc1``. False: one adapter per projection (peft's).
    share_a: bool = bool_field(False)

    def __attrs_post_init__(self) -> None:
        if not self.dropout < 1.0:
            raise ConfigError(f"LoraConfig.dropout must be in [0, 1); got {self.dropout}")

    @property
    def scale(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha) / self.rank


class PartsConfig(Protocol):
    """What backends and platforms read of the engine's config (structural: no upward import)."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def parallel(self) -> ParallelConfig: ...
    @property
    def optimizer(self) -> OptimizerConfig: ...
    @property
    def scheduler(self) -> SchedulerConfig: ...
    @property
    def seed(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def forward_only(self) -> bool: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def router_replay(self) -> bool: ...
    @property
    def lora(self) -> LoraConfig | None: ...
