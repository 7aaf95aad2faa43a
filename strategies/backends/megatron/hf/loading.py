"""Stream a Hugging Face safetensors checkpoint into this rank's GPTModel chunk.

Tensors are read one megatron parameter at a time (q/k/v together), converted to megatron's
full layout, and this rank keeps its tensor-parallel shard, split exactly as ``init`` splits
freshly drawn weights. Peak host memory is about one full tensor plus the local shards. Layers
of other pipeline stages are never read. A value head's output layer keeps the engine's own
initialisation: an LM checkpoint's ``lm_head`` is not loaded into it.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch

from heads.errors import CheckpointError
from strategies.backends.megatron.hf.adapters import adapter_for
from strategies.backends.megatron.init import _shard, global_parameters
from strategies.backends.megatron.model import ReplicatedOutputLayer
from strategies.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsCheckpoint(contextlib.ExitStack):
    """Tensors by name from ``model.safetensors`` or a sharded checkpoint's index."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._handles: dict[str, Any] = {}
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as handle:
                    self.files: dict[str, str] = dict(json.load(handle)["weight_map"])
            except (OSError, ValueError, KeyError) as error:
                raise CheckpointError(f"cannot read the weight_map of {index}: {error}") from error
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            self.files = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        else:
            raise CheckpointError(
                f"{path} holds no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints "
                "are read)"
            )

    def read(self, name: str, shape: torch.Size) -> torch.Tensor:
        """The tensor ``name``; CheckpointError if it is missing or not of ``shape``."""
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint {self.path}")
        handle = self._open(file)
        found = tuple(handle.get_slice(name).get_shape())
        if found != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {os.path.join(self.path, file)} has shape {list(found)}; "
                f"the model config expects {list(shape)}"
            )
        tensor: torch.Tensor = handle.get_tensor(name)
        return tensor

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise CheckpointError(f"checkpoint file {full} is missing")
            try:
                self._handles[file] = self.enter_context(safe_open(full, framework="pt"))
            except Exception as error:
                raise CheckpointError(f"cannot open {full}: {error}") from error
        return self._handles[file]


def load_hf_weights(chunk: torch.nn.Module, config: ModelConfig, path: str) -> None:
    """Copy the checkpoint at ``path`` into ``chunk`` (this rank's stage and TP shard)."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    adapter = adapter_for(config)
    value_head = isinstance(getattr(chunk, "output_layer", None), ReplicatedOutputLayer)
    local_names = [name for name, _ in chunk.named_parameters()]
    with torch.no_grad(), SafetensorsCheckpoint(path) as checkpoint:
        for local_name, (name, param) in zip(local_names, global_parameters(chunk), strict=True):
            if value_head and local_name.startswith("output_layer."):
                continue
            parallel = bool(getattr(param, "tensor_model_parallel", False)) and tp_size > 1
            dim = int(getattr(param, "partition_dim", 0))
            full_shape = list(param.shape)
            if parallel:
                full_shape[dim] *= tp_size
            expected = adapter.to_hf(name, torch.empty(full_shape, device="meta"))
            full = adapter.to_megatron(
                name, [checkpoint.read(hf_name, shape.shape) for hf_name, shape in expected]
            )
            if parallel:
                full = _shard(
                    full, dim, int(getattr(param, "partition_stride", 1)), tp_rank, tp_size
                )
            param.copy_(full.to(dtype=param.dtype, device=param.device))
