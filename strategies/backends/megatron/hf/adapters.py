"""State-dict adapters: Hugging Face tensor names and layouts <-> megatron's full (unsharded)
tensors under the single-process names of ``init.global_parameters``.

One adapter per architecture family. Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Mistral
share the Llama family's names; so do the mixture-of-experts Qwen3-MoE and Mixtral outside their
MLPs, whose router and experts are named by the family's table
(``strategies.hf.experts.EXPERT_NAMES``). A new family adds its adapter class and a case in
``adapter_for``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar

import torch

from strategies.hf.experts import CheckpointLayout
from strategies.part_configs import ModelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_HF_LAYER = "model.layers.{}.{}"
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """megatron's ``linear_qkv`` rows: per query group, its q heads, then its k, then its v."""
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, groups: int, heads: int) -> tuple[torch.Tensor, ...]:
    """Inverse of ``fuse_qkv``: (q, k, v)."""
    per_group = qkv.reshape(groups, -1, *qkv.shape[1:])
    head_dim = per_group.shape[1] // (heads // groups + 2)
    sizes = [head_dim * heads // groups, head_dim, head_dim]
    return tuple(part.reshape(-1, *qkv.shape[1:]) for part in torch.split(per_group, sizes, dim=1))


class LlamaFamilyAdapter:
    """Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral: HF names and layouts <->
    megatron GPTModel. An expert's ``linear_fc1`` is cat(gate, up), as a dense one's."""

    #: megatron name inside a layer -> HF names inside ``model.layers.N`` that make it up.
    #: ``*.layer_norm_weight`` are the TransformerEngine spec's fused-norm names.
    LAYER_NAMES: ClassVar[dict[str, tuple[str, ...]]] = {
        "input_layernorm.weight": ("input_layernorm.weight",),
        "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
        "self_attention.linear_qkv.weight": tuple(f"{n}.weight" for n in _QKV),
        "self_attention.linear_qkv.bias": tuple(f"{n}.bias" for n in _QKV),
        "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
        "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
        "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
        "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
        "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
        "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
    }
    TOP_NAMES: ClassVar[dict[str, tuple[str, ...]]] = {
        "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
        "decoder.final_layernorm.weight": ("model.norm.weight",),
        "output_layer.weight": ("lm_head.weight",),
    }

    def __init__(self, config: ModelConfig) -> None:
        self.heads = config.num_attention_heads
        self.groups = config.num_query_groups or config.num_attention_heads
        self.experts = CheckpointLayout.of(config).experts

    def hf_names(self, name: str) -> tuple[str, ...]:
        """The HF tensors the megatron tensor ``name`` is made of (KeyError if none)."""
        match = _LAYER.match(name)
        if match is None:
            return self.TOP_NAMES[name]
        layer, inner = match.groups()
        if self.experts is not None:
            if inner == "mlp.router.weight":
                return (self.experts.router(layer),)
            expert = _EXPERT.match(inner)
            if expert is not None:
                gate, up, down = self.experts.expert(layer, expert.group(1))
                return (gate, up) if expert.group(2) == "linear_fc1" else (down,)
        return tuple(_HF_LAYER.format(layer, hf) for hf in self.LAYER_NAMES[inner])

    def to_megatron(self, name: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full megatron tensor ``name`` from its HF tensors (in ``hf_names`` order)."""
        if len(tensors) == 3:
            q, k, v = tensors
            return fuse_qkv(q, k, v, self.groups)
        return torch.cat(list(tensors), dim=0) if len(tensors) > 1 else tensors[0]

    def to_hf(self, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Inverse of ``to_megatron``: (HF name, tensor) pairs, each its own storage."""
        names = self.hf_names(name)
        if len(names) == 3:
            parts: Sequence[torch.Tensor] = split_qkv(full, self.groups, self.heads)
        else:
            parts = torch.chunk(full, len(names), dim=0)
        return [(hf, part.clone()) for hf, part in zip(names, parts, strict=True)]


def adapter_for(config: ModelConfig) -> LlamaFamilyAdapter:
    """The state-dict adapter for ``config``'s architecture family."""
    return LlamaFamilyAdapter(config)
