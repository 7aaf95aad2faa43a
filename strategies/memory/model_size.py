"""A model's parameters counted from its ModelConfig, before anything is built, so that a model
too large for a rank's memory is refused naming the sizes that make it so (the allocator's own
``RuntimeError: ... can't allocate memory`` names none). Both backends build this transformer
family; each says what one rank of it holds (:class:`strategies.backends.base.MemoryEstimate`).
"""

from __future__ import annotations

import attrs

from heads.base import OutputSpec
from heads.errors import ConfigError
from strategies.part_configs import ModelConfig, PartsConfig

#: Bytes of a weight of each ``EngineConfig.dtype``.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
#: Bytes per trained parameter beside its weight: a float32 gradient and AdamW's two float32
#: moments (megatron keeps float32 master weights of bfloat16 ones too).
GRADIENT_BYTES, MOMENTS_BYTES = 4, 8
#: A part holding at least this share of the parameters is named in the refusal.
NAMED_SHARE = 0.1


@attrs.frozen
class ModelPart:
    """Parameters of one part of the model, with the config sizes they come from."""

    name: str
    parameters: int
    sizes: str


@attrs.frozen(kw_only=True)
class ParameterCount:
    """The transformer of a ModelConfig with a head's output layer, part by part (all layers
    together; the routed experts apart, as expert parallelism splits them)."""

    embedding: ModelPart
    attention: ModelPart
    mlp: ModelPart
    experts: ModelPart
    norms: ModelPart
    #: The output layer's weight (and bias); 0 where it is the embedding (``tied``).
    output: ModelPart
    #: The output layer is the embedding (a pipeline's last stage holds a copy of it).
    tied: bool

    @property
    def parts(self) -> tuple[ModelPart, ...]:
        return (self.embedding, self.attention, self.mlp, self.experts, self.norms, self.output)

    @property
    def total(self) -> int:
        return sum(part.parameters for part in self.parts)

    @property
    def layers(self) -> int:
        """What the decoder layers hold besides the routed experts (a pipeline splits them)."""
        return self.attention.parameters + self.mlp.parameters + self.norms.parameters

    def largest(self) -> list[ModelPart]:
        """The parts that hold most of the parameters, largest first."""
        ranked = sorted(self.parts, key=lambda part: part.parameters, reverse=True)
        return [ranked[0], *(p for p in ranked[1:] if p.parameters >= NAMED_SHARE * self.total)]


def count_parameters(model: ModelConfig, spec: OutputSpec) -> ParameterCount:
    """Exactly the parameters both backends build for ``model`` under a head of ``spec``."""
    vocab, hidden, layers = model.vocab_size, model.hidden_size, model.num_layers
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    head_dim = model.head_dim or hidden // heads
    projections = hidden * head_dim * (2 * heads + 2 * groups)  # q, o; k, v
    biases = head_dim * (heads + 2 * groups) if model.add_qkv_bias else 0
    query_key_norms = 2 * head_dim if model.qk_layernorm else 0
    attention = ModelPart(
        "attention",
        layers * (projections + biases + query_key_norms),
        f"num_layers={layers} x hidden_size={hidden} x head_dim={head_dim} x "
        f"(2 x num_attention_heads={heads} + 2 x num_query_groups={groups})",
    )
    experts = ModelPart("routed experts", 0, "")
    if model.num_experts is None:
        ffn = model.resolved_ffn_hidden_size
        mlp = ModelPart(
            "MLP",
            layers * 3 * hidden * ffn,
            f"num_layers={layers} x 3 x hidden_size={hidden} x ffn_hidden_size={ffn}",
        )
    else:
        count, ffn = model.num_experts, model.resolved_expert_ffn_hidden_size
        shared = model.shared_expert_ffn_hidden_size or 0
        experts = ModelPart(
            "routed experts",
            layers * count * 3 * hidden * ffn,
            f"num_layers={layers} x num_experts={count} x 3 x hidden_size={hidden} x "
            f"expert_ffn_hidden_size={ffn}",
        )
        mlp = ModelPart(
            "routers and shared experts",
            layers * hidden * (count + 3 * shared),
            f"num_layers={layers} x hidden_size={hidden} x (num_experts={count} + 3 x "
            f"shared_expert_ffn_hidden_size={shared})",
        )
    tied = spec.kind == "vocab" and spec.allow_tied_embeddings and model.tie_embeddings
    if spec.kind == "vocab":
        output = ModelPart(
            "output layer",
            0 if tied else vocab * hidden,
            f"vocab_size={vocab} x hidden_size={hidden}",
        )
    else:
        output = ModelPart(
            "output layer",
            spec.features * (hidden + int(model.head_bias)),
            f"hidden_size={hidden} x {spec.features} output(s)",
        )
    return ParameterCount(
        embedding=ModelPart(
            "embedding", vocab * hidden, f"vocab_size={vocab} x hidden_size={hidden}"
        ),
        attention=attention,
        mlp=mlp,
        experts=experts,
        norms=ModelPart(
            "norms",
            (2 * layers + 1) * hidden,
            f"(2 x num_layers={layers} + 1) x hidden_size={hidden}",
        ),
        output=output,
        tied=tied,
    )


@attrs.frozen(kw_only=True)
class RankMemory:
    """What one rank holds of a model at the peak of its build and training state."""

    parameters: int
    bytes: int
    #: What ``bytes`` counts, for the refusal (``float32 weights of the whole model ...``).
    counted: str


def training_state(
    config: PartsConfig, *, master_bytes: int = 0, optimizer_shards: int = 1
) -> tuple[float, str]:
    """Bytes per parameter that training keeps beside the weight, and what they are: none for a
    forward-only engine or under LoRA (only the adapters train). ``optimizer_shards``: the ranks
    the optimizer state (moments and ``master_bytes`` of master weights) is split over."""
    if config.forward_only or config.lora is not None:
        return 0.0, ""
    state = "two moments and master weights" if master_bytes else "two moments"
    split = f", split over {optimizer_shards} ranks" if optimizer_shards > 1 else ""
    return (
        GRADIENT_BYTES + (MOMENTS_BYTES + master_bytes) / optimizer_shards,
        f", float32 gradients and AdamW's float32 state ({state}{split})",
    )


def check_fits(count: ParameterCount, need: RankMemory, available: int, where: str) -> None:
    """ConfigError naming the parameters, the bytes per rank and the sizes behind them when a
    rank needs more than ``available`` bytes of ``where``."""
    if need.bytes <= available:
        return
    *others, last = (f"the {part.name} ({part.sizes})" for part in count.largest())
    parts = f"{', '.join(others)} and {last}" if others else last
    raise ConfigError(
        f"the model is too large to allocate: {count.total:,} parameters, mostly {parts}; one "
        f"rank holds {need.parameters:,} of them, {readable_bytes(need.bytes)} "
        f"({need.counted}), but {where} has {readable_bytes(available)} available; make those "
        "ModelConfig sizes smaller"
    )


def readable_bytes(count: int) -> str:
    """``count`` bytes in the largest binary unit that keeps it >= 1 (``1.5 GiB``)."""
    value, unit = float(count), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:,.1f} {unit}"
