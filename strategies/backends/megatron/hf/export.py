"""This rank's chunk as Hugging Face tensors, one full tensor at a time, or as shards of them.

Tensor-parallel shards are all-gathered (experts' over the expert tensor-parallel group), so
every TP rank yields the same full tensors. Under expert parallelism each local expert is
all-gathered over the expert-parallel group, so every rank yields every expert, under its
global number. Under pipeline parallelism each stage yields only its own layers (and the last
stage not its copy of a tied embedding): the union over stages is the whole model. A value
or reward head's layer (replicated: every rank holds it whole) is yielded as a classifier's
``score.weight`` (and ``score.bias`` where it has one).

:func:`param_shards` describes the same tensors without gathering anything: each parameter's
local shard, where it lies in the full parameter (the tensor-parallel split, this rank's experts
under their global numbers) and the Hugging Face tensors the full parameter makes, found by
running the same ``adapter.to_hf`` on the parameter's row numbers
(``strategies.hf.shards``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from strategies.backends.megatron.hf.adapters import adapter_for
from strategies.backends.megatron.lora import (
    LINEARS,
    adapter_parameters,
    adapter_tensors,
    head_output_layer,
    is_adapter_parameter,
    layer_adapters,
    merged_delta,
)
from strategies.backends.megatron.model import ReplicatedOutputLayer
from strategies.backends.megatron.weight_init import (
    TensorParallelLayout,
    expert_number,
    global_parameters,
    is_expert_parameter,
    renumber_expert,
    unshard,
)
from strategies.hf.classification import score_name
from strategies.hf.shards import ParamShard
from strategies.part_configs import ModelConfig, PartsConfig

_LAYER_WEIGHT = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.weight$")


def export_hf(
    chunk: torch.nn.Module, config: ModelConfig, parts: PartsConfig | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter of ``chunk``, in the dtype the source
    checkpoint states (``ModelConfig.checkpoint_dtype``) when there is one. With LoRA
    (``parts.lora``) the adapted linears come out merged, ``W + (B @ A) * scale``."""
    dtype = _export_dtype(config)
    for name, tensor in _full_tensors(chunk, config, parts):
        yield name, tensor if dtype is None else tensor.to(dtype)


def param_shards(
    chunk: torch.nn.Module, config: ModelConfig, *, adapter_only: bool = False
) -> Iterator[ParamShard]:
    """This rank's parameters of ``chunk`` as shards of the Hugging Face tensors ``export_hf``
    yields (without LoRA), or with ``adapter_only`` of those ``export_adapter`` yields. Nothing
    is gathered or copied."""
    head_layer = head_output_layer(chunk)
    if adapter_only:
        for hf_name, global_name, param in adapter_parameters(chunk):
            yield _param_shard(global_name, param, functools.partial(_named, hf_name), None)
        for name, param in head_layer.named_parameters() if head_layer is not None else ():
            probe = functools.partial(_named, score_name(name))
            yield _param_shard(f"output_layer.{name}", param, probe, None)
        return
    adapter = adapter_for(config)
    dtype = _export_dtype(config)
    local_names = [name for name, _ in chunk.named_parameters()]
    for local_name, (name, param) in zip(local_names, global_parameters(chunk), strict=True):
        if local_name.startswith("output_layer.") and getattr(param, "shared_embedding", False):
            continue  # the last stage's copy of a tied embedding: the first stage's is yielded
        if is_adapter_parameter(local_name):
            continue
        if head_layer is not None and local_name.startswith("output_layer."):
            probe = functools.partial(_named, score_name(local_name))
        else:
            probe = functools.partial(adapter.to_hf, name)
        yield _param_shard(name, param, probe, dtype)


def _named(name: str, rows: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The probe of a parameter that is one Hugging Face tensor, under ``name``."""
    return [(name, rows)]


def _param_shard(
    name: str, param: torch.Tensor, probe: Any, dtype: torch.dtype | None
) -> ParamShard:
    """``param``'s shard: its rows (split along dim 0) or columns (along dim 1) of the full
    parameter, from the split megatron made (``TensorParallelLayout``)."""
    layout = TensorParallelLayout.of(name, param)
    local = param.detach()
    rows = torch.arange(local.shape[0])
    width = local.shape[1] if local.dim() > 1 else 1
    columns = (0, width)
    if layout.size > 1:
        numbers = layout.indices()
        if layout.dim == 0:
            rows = numbers
        elif not torch.equal(numbers, torch.arange(int(numbers[0]), int(numbers[0]) + width)):
            raise NotImplementedError(f"{name}: a strided split of its columns is not a block")
        else:
            columns = (int(numbers[0]), int(numbers[0]) + width)
    return ParamShard.probed(name, local, layout.full_shape, rows, columns, probe, dtype=dtype)


def _export_dtype(config: ModelConfig) -> torch.dtype | None:
    """The dtype the source checkpoint states (None: the parameters' own)."""
    return getattr(torch, config.checkpoint_dtype) if config.checkpoint_dtype else None


def export_adapter(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) of the chunk's LoRA adapters (peft's names), then of a
    non-vocabulary head's output layer, which trains with them (``score.weight``)."""
    yield from adapter_tensors(chunk, _tensor_parallel_full)
    head_layer = head_output_layer(chunk)
    if head_layer is not None:  # replicated over tensor-parallel ranks
        for name, param in head_layer.named_parameters():
            yield score_name(name), param.detach().clone()


def _full_tensors(
    chunk: torch.nn.Module, config: ModelConfig, parts: PartsConfig | None
) -> Iterator[tuple[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    adapter = adapter_for(config)
    adapters = layer_adapters(chunk) if parts is not None and parts.lora is not None else {}
    ep_size = ps.get_expert_model_parallel_world_size() if config.is_moe else 1
    per_rank = (config.num_experts or 0) // ep_size
    value_head = isinstance(getattr(chunk, "output_layer", None), ReplicatedOutputLayer)
    local_names = [name for name, _ in chunk.named_parameters()]
    for local_name, (name, param) in zip(local_names, global_parameters(chunk), strict=True):
        head_layer = local_name.startswith("output_layer.")
        if head_layer and getattr(param, "shared_embedding", False):
            continue  # the last stage's copy of a tied embedding: the first stage yields it
        if is_adapter_parameter(local_name):
            continue  # merged into the linear it adapts
        full = _tensor_parallel_full(name, param)
        if adapters:
            full = _merged(name, full, adapters, parts)
        if value_head and head_layer:
            yield score_name(local_name), full.clone()
        elif ep_size > 1 and (local := expert_number(local_name)) is not None:
            group = ps.get_expert_model_parallel_group()
            for ep_rank, expert in enumerate(_all_gather(full, ep_size, group)):
                yield from adapter.to_hf(renumber_expert(name, ep_rank * per_rank + local), expert)
        else:
            yield from adapter.to_hf(name, full)


def _merged(
    name: str, full: torch.Tensor, adapters: dict[int, Any], parts: PartsConfig | None
) -> torch.Tensor:
    """``full`` plus its adapters' ``(B @ A) * scale`` when ``name`` is an adapted linear."""
    match = _LAYER_WEIGHT.match(name)
    if match is None or parts is None or match.group(2) not in LINEARS:
        return full
    layer = int(match.group(1))
    delta = merged_delta(layer, match.group(2), adapters[layer], _tensor_parallel_full, parts)
    return full if delta is None else (full.float() + delta).to(full.dtype)


def _tensor_parallel_full(name: str, param: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter sharded over its (expert) tensor-parallel group."""
    from megatron.core import parallel_state as ps

    layout = TensorParallelLayout.of(name, param)
    full = param.detach()
    if layout.size == 1:
        return full
    group = (
        ps.get_expert_tensor_parallel_group()
        if is_expert_parameter(name)
        else ps.get_tensor_model_parallel_group()
    )
    return unshard(_all_gather(full, layout.size, group), layout.dim, layout.stride)


def _all_gather(tensor: torch.Tensor, size: int, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``tensor`` in ``group``, in group-rank order."""
    gathered = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered
