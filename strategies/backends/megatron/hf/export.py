"""This rank's chunk as Hugging Face tensors, one full tensor at a time.

Tensor-parallel shards are all-gathered, so every TP rank yields the same full tensors. Under
pipeline parallelism each stage yields only its own layers (and the last stage not its copy of
a tied embedding): the union over stages is the whole model. A value head's layer is yielded as
``value_head.weight``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from strategies.backends.megatron.hf.adapters import adapter_for
from strategies.backends.megatron.init import global_parameters, unshard
from strategies.backends.megatron.model import ReplicatedOutputLayer
from strategies.config import ModelConfig

VALUE_HEAD = "value_head.weight"


def export_hf(chunk: torch.nn.Module, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter of ``chunk``, in the dtype the source
    checkpoint states (``ModelConfig.checkpoint_dtype``) when there is one."""
    dtype = getattr(torch, config.checkpoint_dtype) if config.checkpoint_dtype else None
    for name, tensor in _full_tensors(chunk, config):
        yield name, tensor if dtype is None else tensor.to(dtype)


def _full_tensors(
    chunk: torch.nn.Module, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp_size > 1 else None
    adapter = adapter_for(config)
    value_head = isinstance(getattr(chunk, "output_layer", None), ReplicatedOutputLayer)
    local_names = [name for name, _ in chunk.named_parameters()]
    for local_name, (name, param) in zip(local_names, global_parameters(chunk), strict=True):
        head_layer = local_name.startswith("output_layer.")
        if head_layer and getattr(param, "shared_embedding", False):
            continue  # the last stage's copy of a tied embedding: the first stage yields it
        full = param.detach()
        if group is not None and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(full) for _ in range(tp_size)]
            dist.all_gather(shards, full.contiguous(), group=group)
            full = unshard(
                shards,
                int(getattr(param, "partition_dim", 0)),
                int(getattr(param, "partition_stride", 1)),
            )
        if value_head and head_layer:
            yield VALUE_HEAD, full.clone()
        else:
            yield from adapter.to_hf(name, full)
