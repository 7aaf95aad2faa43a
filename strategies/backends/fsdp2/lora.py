"""LoRA on the Hugging Face model, before it is sharded: each target linear gets peft's
``lora_A`` / ``lora_B`` children (so the adapters carry peft's names,
``model.layers.0.self_attn.q_proj.lora_A.weight``) and a forward hook that adds
``B A dropout(x) * alpha / rank`` to its output; every other parameter is frozen. ``A`` is drawn
from (seed, that name) as the megatron backend draws it, so both backends start equal.
A non-vocabulary head's output layer (``value_head``, value and reward heads) is new, so it
trains whole beside the adapters (peft's ``modules_to_save``). With ``share_a`` the projections
of a fused linear hold one ``lora_A`` module (one parameter); with dropout each projection's
hook draws its own mask (the megatron backend draws one per fused linear).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from heads.errors import ConfigError
from strategies.backends.fsdp2.model import VALUE_HEAD
from strategies.model.peft_lora import (
    AdapterSwitch,
    LoraPair,
    a_owner,
    adapter_names,
    draw_a,
    hf_module,
    low_rank_update,
)
from strategies.part_configs import LoraConfig, PartsConfig


def check_lora(config: PartsConfig) -> None:
    if config.model.is_moe:
        raise ConfigError(
            "EngineConfig.lora on a mixture-of-experts model is not supported by the fsdp2 "
            "backend yet (expert linears get no adapters); use a dense model"
        )


def attach_adapters(model: torch.nn.Module, config: PartsConfig, switch: AdapterSwitch) -> None:
    """Freeze ``model`` but a non-vocabulary head's output layer, and add the adapters of
    ``config.lora`` to its decoder layers."""
    lora = config.lora
    assert lora is not None
    for param in model.parameters():
        param.requires_grad_(False)
    for name, param in model.named_parameters():
        if is_head_layer_parameter(name):
            param.requires_grad_(True)
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, torch.nn.ModuleList)
    for layer in range(len(layers)):
        for target in lora.target_modules:
            linear = model.get_submodule(hf_module(layer, target))
            assert isinstance(linear, torch.nn.Linear)
            pair = LoraPair(linear.in_features, lora.rank, linear.out_features)
            pair.to(device=linear.weight.device, dtype=linear.weight.dtype)
            owner = a_owner(target, lora)
            with torch.no_grad():
                a_name, _ = adapter_names(layer, owner)
                pair.lora_A.weight.copy_(
                    draw_a((lora.rank, linear.in_features), config.seed, a_name, lora.a_init)
                )
                pair.lora_B.weight.zero_()
            lora_a: torch.nn.Module = pair.lora_A
            if owner != target:  # share_a: the fused projections' first target's A
                lora_a = model.get_submodule(f"{hf_module(layer, owner)}.lora_A")
            linear.add_module("lora_A", lora_a)
            linear.add_module("lora_B", pair.lora_B)
            linear.register_forward_hook(_hook(lora, switch))


def _hook(lora: LoraConfig, switch: AdapterSwitch) -> Callable[..., Any]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        if not switch.enabled:
            return output
        lora_a, lora_b = module.get_submodule("lora_A"), module.get_submodule("lora_B")
        low = low_rank_update(args[0], lora_a, lora, module.training)
        return output + (lora_b(low) * lora.scale).to(output.dtype)

    return hook


def is_adapter_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_head_layer_parameter(name: str) -> bool:
    """A parameter of a non-vocabulary head's own output layer (it trains with LoRA)."""
    return name.startswith(f"{VALUE_HEAD}.")
