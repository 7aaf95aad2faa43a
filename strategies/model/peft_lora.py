"""Low-rank adapters shared by the backends: the adapter pair, its layout-independent
initialisation, its Hugging Face / PEFT names and the PEFT adapter directory.

An adapter is named after the Hugging Face linear it adapts, as peft names it
(``model.layers.3.self_attn.q_proj.lora_A.weight``): both backends draw ``A`` from (seed, that
name), so every backend and parallel layout starts from the same adapter. ``A`` is drawn as
peft draws it (``kaiming_uniform_(a=sqrt(5))``: uniform in ``+-1/sqrt(in_features)``) or
Xavier-uniform, ``B`` is 0, so a new adapter leaves the model's outputs unchanged. With
``share_a`` the projections of one fused linear use one ``A`` (one module, so one parameter,
one gradient and one optimizer state), named after the first of them; a PEFT adapter holds a
copy under each projection's name.

A head whose output is not the vocabulary (value, reward) has an output layer of its own: with
LoRA it trains whole, beside the adapters (peft's ``modules_to_save``). Both backends export it
as a classifier's ``score.weight`` (and ``score.bias`` where it has one); in a PEFT adapter it is
transformers' ``...ForTokenClassification`` ``score`` layer (``hidden -> features``, with a
bias, written as 0 where the engine's layer has none).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator

import attrs
import torch

from strategies.checkpoint_files.publish import publish_directory
from strategies.hf.classification import SCORE, SCORE_BIAS, SCORE_WEIGHT, with_score_bias
from strategies.hf.shards import ParamShard
from strategies.model.weight_draws import name_seed
from strategies.parallel.collectives import barrier, merged_dicts, rank
from strategies.part_configs import LoraConfig, ModelConfig

#: The key prefix of peft's saved adapters (``PeftModel`` -> ``base_model`` -> ``model``).
PEFT_PREFIX = "base_model.model."
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
#: The targets one fused linear computes (megatron's ``linear_qkv``, ``linear_fc1``).
FUSED_TARGETS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def hf_module(layer: int, target: str) -> str:
    """The Hugging Face name of layer ``layer``'s linear ``target`` (e.g. ``q_proj``)."""
    block = "self_attn" if target in _ATTENTION else "mlp"
    return f"model.layers.{layer}.{block}.{target}"


def adapter_names(layer: int, target: str) -> tuple[str, str]:
    """The Hugging Face names of the adapter's ``A`` and ``B`` (peft's, without its prefix)."""
    module = hf_module(layer, target)
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


class LoraPair(torch.nn.Module):
    """``lora_A`` (``in -> rank``) and ``lora_B`` (``rank -> out``), both without bias, as
    peft's modules (so their state-dict names are peft's); either may hold a tensor-parallel
    shard."""

    def __init__(self, in_features: int, rank: int, out_features: int) -> None:
        super().__init__()
        self.lora_A = torch.nn.Linear(in_features, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, out_features, bias=False)
        for param in self.parameters():
            param.requires_grad_(True)


def draw_a(shape: tuple[int, int], seed: int, name: str, init: str = "kaiming") -> torch.Tensor:
    """The full float32 ``A`` (``[rank, in_features]``) of the adapter named ``name``, drawn as
    ``LoraConfig.a_init`` says."""
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    rank, fan_in = shape
    bound = (6.0 / (fan_in + rank)) ** 0.5 if init == "xavier" else 1.0 / fan_in**0.5
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def a_owner(target: str, config: LoraConfig) -> str:
    """The target whose ``A`` the adapter of ``target`` uses: its own, or with
    ``LoraConfig.share_a`` the first adapted target of its fused linear (its ``A`` is drawn
    under that target's name)."""
    if config.share_a:
        for group in FUSED_TARGETS:
            if target in group:
                return next(name for name in group if name in config.target_modules)
    return target


class AdapterSwitch:
    """Whether the adapters take part in the forward (off: the base model, exactly)."""

    def __init__(self) -> None:
        self.enabled = True


def low_rank_update(
    x: torch.Tensor, lora_a: torch.nn.Module, config: LoraConfig, training: bool
) -> torch.Tensor:
    """``A dropout(x)``, the rank-r activation an adapter's ``B`` maps back up."""
    if config.dropout and training:
        x = torch.nn.functional.dropout(x, p=config.dropout, training=True)
    result: torch.Tensor = lora_a(x)
    return result


def adapter_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """What an adapter adds to its linear's weight, ``(B @ A) * scale``, float32; a merged
    weight is ``(W.float() + delta).to(W.dtype)``."""
    return (b.float() @ a.float()) * scale


def peft_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Exported (Hugging Face name, tensor) pairs of adapters and a head layer under peft's
    names, ``base_model.model.`` + the name; the head layer (``score.weight``, which
    ``export_adapter`` yields last) with a zero ``score.bias`` where the engine's layer has
    none (the layer of transformers' token classifier, which the adapter loads onto, has one)."""
    head_layer: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.startswith(f"{SCORE}."):
            head_layer[name] = tensor
        else:
            yield PEFT_PREFIX + name, tensor
    for name, tensor in with_score_bias(head_layer).items():
        yield PEFT_PREFIX + name, tensor


def peft_shards(shards: Iterable[ParamShard]) -> Iterator[ParamShard]:
    """``peft_tensors`` for shards (``strategies.hf.shards``): their Hugging Face tensors under
    peft's names, and the zero ``score.bias`` a head layer without one gets, whole on every
    rank that holds part of its ``score.weight``."""
    names: set[str] = set()
    score: ParamShard | None = None
    for shard in shards:
        names.update(name for name, _, _ in shard.hf)
        if any(name == SCORE_WEIGHT for name, _, _ in shard.hf):
            score = shard
        hf = tuple((PEFT_PREFIX + name, shape, rows) for name, shape, rows in shard.hf)
        yield attrs.evolve(shard, hf=hf)
    if score is None or SCORE_BIAS in names:
        return
    (_, (features, _), _), *_ = score.hf
    bias = score.local.new_zeros(features)
    rows = torch.arange(features)
    yield ParamShard(
        name=SCORE_BIAS,
        local=bias,
        rows=rows,
        columns=(0, 1),
        hf=((PEFT_PREFIX + SCORE_BIAS, (features,), rows),),
    )


def peft_config(config: LoraConfig, model: ModelConfig, head_layer: bool) -> dict[str, object]:
    """``adapter_config.json`` of a PEFT LoRA adapter: for a causal LM, or (``head_layer``)
    for a token-classification model whose ``score`` layer is saved whole."""
    return {
        "peft_type": "LORA",
        "task_type": "TOKEN_CLS" if head_layer else "CAUSAL_LM",
        "base_model_name_or_path": model.hf_path,
        "r": config.rank,
        "lora_alpha": config.rank if config.alpha is None else config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": list(config.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": [SCORE] if head_layer else None,
    }


def save_peft_adapter(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: LoraConfig,
    model: ModelConfig,
    directory: str,
    head_layer: bool = False,
) -> None:
    """Write a PEFT adapter directory (collective): every rank hands the adapter tensors it
    yields under PEFT names (pipeline stages their own layers, the last one the head layer);
    rank 0 writes them all. ``head_layer``: the adapter saves a head's output layer whole."""
    from safetensors.torch import save_file

    local = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors}
    every = merged_dicts(local)
    directory = os.path.abspath(directory)
    if rank() == 0:
        staging = directory + ".saving"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        save_file(dict(sorted(every.items())), os.path.join(staging, PEFT_WEIGHTS))
        with open(os.path.join(staging, PEFT_CONFIG), "w") as handle:
            json.dump(peft_config(config, model, head_layer), handle, indent=2)
        publish_directory(staging, directory)
    barrier()
