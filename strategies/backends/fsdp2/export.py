"""The model as Hugging Face tensors, one full tensor at a time, and as a checkpoint that
transformers loads (``AutoModelForCausalLM``; a value or reward head's as a token or sequence
classifier, ``strategies.hf.classification``).

Parameters already carry Hugging Face names; each sharded parameter is all-gathered on its own
(``DTensor.full_tensor``), so no rank ever holds more than one full tensor for export. Collective:
every rank walks the parameters in the same order. A value or reward head's layer is yielded as
a classifier's ``score.weight`` (and ``score.bias`` where it has one), as megatron's. Experts
that transformers fuses in memory are yielded per expert, under the names its checkpoints use.

:func:`param_shards` describes the same tensors without gathering: each parameter's local shard
(FSDP2 splits dim 0) and the Hugging Face tensors the full parameter makes, found by running
the same ``CheckpointLayout.split`` on its row numbers (``strategies.hf.shards``).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch

from strategies.backends.fsdp2.lora import is_adapter_parameter, is_head_layer_parameter
from strategies.backends.fsdp2.sharding import on_mesh_device
from strategies.checkpoint_files.publish import publish_directory
from strategies.hf.classification import (
    TOKEN_CLASSIFICATION,
    HeadLayer,
    score_name,
    with_score_bias,
)
from strategies.hf.experts import CheckpointLayout
from strategies.hf.files import SINGLE_FILE
from strategies.hf.metadata import write_hf_metadata
from strategies.hf.shards import ParamShard
from strategies.model.peft_lora import adapter_delta
from strategies.parallel.collectives import barrier, rank
from strategies.part_configs import LoraConfig, ModelConfig


def export_hf(
    model: torch.nn.Module, config: ModelConfig, lora: LoraConfig | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) for every parameter (a tied ``lm_head`` once, as the
    embedding; fused experts one tensor per expert projection), each a tensor of its own. With
    LoRA the adapted linears come out merged, ``W + (B @ A) * scale``, and the adapters not."""
    layout = CheckpointLayout.of(config)
    for name, param in model.named_parameters():
        if is_adapter_parameter(name):
            continue
        full = _full(param)
        if lora is not None and name.endswith(".weight"):
            linear = model.get_submodule(name.rpartition(".")[0])
            if isinstance(getattr(linear, "lora_A", None), torch.nn.Module):
                delta = adapter_delta(
                    _full(linear.get_parameter("lora_A.weight")),
                    _full(linear.get_parameter("lora_B.weight")),
                    lora.scale,
                )
                full = (full.float() + delta).to(full.dtype)
        if is_head_layer_parameter(name):
            yield score_name(name), full
        else:
            yield from layout.split(name, full)


def export_adapter(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name as peft has it, full tensor) of every LoRA adapter tensor, then of a
    non-vocabulary head's output layer, which trains with them (``score.weight``)."""
    # every projection's A, a shared one (LoraConfig.share_a) under each projection's name
    for name, param in model.named_parameters(remove_duplicate=False):
        if is_adapter_parameter(name):
            yield name, _full(param)
    for name, param in model.named_parameters():
        if is_head_layer_parameter(name):
            yield score_name(name), _full(param)


def param_shards(
    model: torch.nn.Module, config: ModelConfig, *, adapter_only: bool = False
) -> Iterator[ParamShard]:
    """This rank's shards of the Hugging Face tensors ``export_hf`` yields (without LoRA), or
    with ``adapter_only`` of those ``export_adapter`` yields. Nothing is gathered or copied."""
    layout = CheckpointLayout.of(config)
    for name, param in model.named_parameters(remove_duplicate=not adapter_only):
        head_layer = is_head_layer_parameter(name)
        if adapter_only != is_adapter_parameter(name) and not (adapter_only and head_layer):
            continue
        if head_layer:
            probe = functools.partial(_named, score_name(name))
        elif adapter_only:
            probe = functools.partial(_named, name)
        else:
            probe = functools.partial(layout.split, name)
        yield _param_shard(name, param, probe)


def _named(name: str, rows: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The probe of a parameter that is one Hugging Face tensor, under ``name``."""
    return [(name, rows)]


def _param_shard(name: str, param: torch.Tensor, probe: Any) -> ParamShard:
    """``param``'s local shard: whole, or FSDP2's block of its first dimension."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    held = param.detach()
    shape = tuple(held.shape)
    local, first, count = held, 0, shape[0]
    if isinstance(held, DTensor):
        local = held.to_local()
        local_shape, offset = compute_local_shape_and_global_offset(
            shape, held.device_mesh, list(held.placements)
        )
        if tuple(local_shape[1:]) != shape[1:] or any(offset[1:]):
            raise NotImplementedError(f"{name}: sharded along a dimension other than the first")
        first, count = int(offset[0]), int(local_shape[0])
    per_index = math.prod(shape[1:-1]) if len(shape) > 1 else 1  # rows of the row view
    rows = torch.arange(first * per_index, (first + count) * per_index)
    width = shape[-1] if len(shape) > 1 else 1
    return ParamShard.probed(name, local, shape, rows, (0, width), probe)


def _full(param: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly sharded) parameter, in storage of its own (collective)."""
    from torch.distributed.tensor import DTensor

    held = param.detach()
    shard = held.to_local() if isinstance(held, DTensor) else held
    full = on_mesh_device(held).full_tensor() if isinstance(held, DTensor) else held
    if full.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr():
        full = full.clone()  # a world of one may hand back the parameter's own storage
    return full


def save_hf(
    model: torch.nn.Module,
    config: ModelConfig,
    layer: HeadLayer,
    directory: str,
    lora: LoraConfig | None = None,
) -> None:
    """Write the model as a Hugging Face checkpoint in ``directory`` (a causal LM, or the
    classifier ``layer`` makes it): rank 0 gathers the tensors, writes safetensors and
    ``config.json`` (the source checkpoint's, with its tokenizer files, or the one the
    ModelConfig describes) into a temporary sibling and renames it."""
    from safetensors.torch import save_file

    task = layer.export_task()
    directory = os.path.abspath(directory)
    staging = directory + ".saving"
    writer = rank() == 0
    if writer:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    tensors = {
        name: tensor.contiguous() for name, tensor in export_hf(model, config, lora) if writer
    }
    if writer:
        if task == TOKEN_CLASSIFICATION:
            tensors = with_score_bias(tensors)
        save_file(tensors, os.path.join(staging, SINGLE_FILE), metadata={"format": "pt"})
        write_hf_metadata(config, layer, staging, {}, 1)
        publish_directory(staging, directory)
    barrier()
