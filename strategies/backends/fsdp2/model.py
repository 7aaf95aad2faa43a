"""A Hugging Face causal-LM body with the last layer the head's spec asks for, its weights drawn
from (seed, global name) or read from the model's Hugging Face checkpoint.

Parameters carry their Hugging Face names (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``), so export needs no adapter beyond the experts of a mixture of experts
(Qwen3-MoE, Mixtral: transformers' own MoE modules), which transformers 5.x fuses per layer in
memory: they are read, drawn and exported under the checkpoints' per-expert names
(``strategies.hf.experts.CheckpointLayout``). transformers' body model returns no router
load-balancing (aux) loss, so ``ModelConfig.router_aux_loss_coeff`` does not enter the loss on
this backend. A replicated output layer (value and reward heads) is ``value_head`` (the name
engine checkpoints hold; a classifier checkpoint's and exports' is ``score``): read from a
classifier checkpoint's ``score`` layer, or drawn under megatron's name for it,
``output_layer.weight``, so with the same checkpoint both backends start a value or reward
model from the same weights.

Initialisation scheme (megatron's): matrices and embeddings ~ N(0, std); each layer's output
projections (``o_proj``, ``down_proj``, each expert's ``down_proj`` / ``w2``) ~ N(0, std /
sqrt(2 * num_layers)); norm weights 1; biases 0. Every full tensor is drawn on the host from
(seed, name), before sharding, so any data-parallel layout starts from the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch

from heads.base import OutputSpec
from strategies.backends.fsdp2.attention import packed_sdpa
from strategies.hf.architecture import hf_config_for
from strategies.hf.classification import HeadLayer, score_name
from strategies.hf.experts import CheckpointLayout
from strategies.hf.files import SafetensorsCheckpoint
from strategies.model.weight_draws import normal_from_name
from strategies.part_configs import PartsConfig

LM_HEAD = "lm_head"
VALUE_HEAD = "value_head"
#: The global name a replicated output layer is drawn under (megatron's ``output_layer``).
REPLICATED_INIT_NAME = "output_layer.weight"
_SCALED_OUTPUTS = ("self_attn.o_proj.weight", "down_proj.weight", ".w2.weight")


class CausalModel(torch.nn.Module):
    """``model``: the transformers base model (embeddings, decoder layers, final norm); and the
    output layer, ``lm_head`` (over the vocabulary, tied to the embedding where the config
    says) or ``value_head`` (a new ``hidden -> features`` layer, never tied)."""

    def __init__(self, body: torch.nn.Module, output_name: str, output: torch.nn.Linear) -> None:
        super().__init__()
        self.model = body
        self.output_name = output_name
        self.add_module(output_name, output)

    @property
    def decoder_layers(self) -> list[torch.nn.Module]:
        return list(self.model.layers)  # type: ignore[arg-type]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        fused_head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        sequence_group: Any = None,
        **attention: Any,
    ) -> Any:
        """The raw output ``[b, s, features]`` of ``input_ids``: right-padded rows (causal; a
        padding ``attention_mask`` only changes what the padding positions see), or a packed row
        with its ``attention`` keywords (``strategies.backends.fsdp2.attention``); with
        ``fused_head``, what ``fused_head(final hidden states, output weight)`` returns instead,
        computed inside this forward: there FSDP2 holds the (root's) output weight gathered, and
        its gradient reaches the reduce-scatter as the output layer's would. With
        ``sequence_group`` (Ulysses), the inputs are this rank's part of the rows, and so are
        the outputs (``fsdp2.ulysses``)."""
        if sequence_group is not None:
            attention["sequence_group"] = sequence_group
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **attention,
        ).last_hidden_state
        layer = self.get_submodule(self.output_name)
        if fused_head is not None:
            return fused_head(hidden, cast(torch.Tensor, layer.weight))
        output: torch.Tensor = layer(hidden)
        return output


def build_causal_model(
    config: PartsConfig,
    spec: OutputSpec,
    layer: HeadLayer,
    device: torch.device,
    attention: str,
    weights_dtype: torch.dtype = torch.float32,
) -> CausalModel:
    """The full (unsharded) model on ``device``, its weights in ``weights_dtype`` and in place
    (``layer``: the head layer's bias and whether the checkpoint holds it). Weights are drawn or
    read in float32 and rounded to ``weights_dtype``."""
    from transformers import AutoModel

    model_config = config.model
    hf_config = hf_config_for(model_config)
    with torch.device(device):
        # sdpa: transformers' own for right-padded rows, and packed rows too
        implementation = packed_sdpa() if attention == "sdpa" else attention
        body = AutoModel.from_config(
            hf_config, attn_implementation=implementation, dtype=weights_dtype
        )
        hidden = model_config.hidden_size
        if spec.kind == "vocab":
            output = torch.nn.Linear(
                hidden, model_config.vocab_size, bias=False, dtype=weights_dtype
            )
            if spec.allow_tied_embeddings and model_config.tie_embeddings:
                output.weight = body.get_input_embeddings().weight
            model = CausalModel(body, LM_HEAD, output)
        else:
            model = CausalModel(
                body,
                VALUE_HEAD,
                torch.nn.Linear(hidden, spec.features, bias=layer.bias, dtype=weights_dtype),
            )
    if model_config.hf_path is None:
        initialize_parameters(model, config)
    else:
        load_hf_weights(model, model_config.hf_path, CheckpointLayout.of(model_config), layer)
        if spec.kind == "replicated" and not layer.from_checkpoint:  # a causal LM's checkpoint
            initialize_parameters(model, config, only=(VALUE_HEAD,))
    return model


def initialize_parameters(
    model: torch.nn.Module, config: PartsConfig, only: tuple[str, ...] | None = None
) -> None:
    """Re-draw every parameter of a model with Hugging Face names (or those whose name starts
    with one of ``only``) from (seed, checkpoint name): a fused expert tensor is drawn per
    expert, as the checkpoint stores it, whether or not transformers fuses it."""
    std = config.model.init_method_std
    scaled_std = std / math.sqrt(2.0 * config.model.num_layers)
    layout = CheckpointLayout.of(config.model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if only is not None and not name.startswith(only):
                continue
            if param.dim() == 1:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            parts = layout.split(name, torch.empty(param.shape, device="meta"))
            drawn = [
                normal_from_name(
                    part.shape,
                    scaled_std if stored.endswith(_SCALED_OUTPUTS) else std,
                    config.seed,
                    REPLICATED_INIT_NAME if name.startswith(VALUE_HEAD) else stored,
                )
                for stored, part in parts
            ]
            full = layout.join(name, param.shape, drawn)
            param.copy_(full.to(dtype=param.dtype, device=param.device))


def load_hf_weights(
    model: CausalModel, path: str, layout: CheckpointLayout, layer: HeadLayer
) -> None:
    """Copy the safetensors checkpoint at ``path`` (its tensors named as ``layout`` says) into
    ``model``, one parameter at a time. A value or reward head's layer is a classifier's
    ``score`` layer, or keeps its own initialisation (an LM's ``lm_head`` is not loaded)."""
    with torch.no_grad(), SafetensorsCheckpoint(path) as checkpoint:
        for name, param in model.named_parameters():
            if name.startswith(VALUE_HEAD):
                if layer.from_checkpoint:
                    param.copy_(checkpoint.read(score_name(name), param.shape).to(param.dtype))
                continue
            parts = layout.split(name, torch.empty(param.shape, device="meta"))
            full = layout.join(
                name, param.shape, [checkpoint.read(stored, part.shape) for stored, part in parts]
            )
            param.copy_(full.to(param.dtype))
