"""Stream a Hugging Face safetensors checkpoint into this rank's GPTModel chunk.

Tensors are read one megatron parameter at a time (q/k/v together), converted to megatron's
full layout, and this rank keeps its tensor-parallel shard (experts: their expert
tensor-parallel shard), split exactly as ``init`` splits freshly drawn weights. Under expert
parallelism a rank reads only its own experts, by their global numbers. Peak host memory is
about one full tensor plus the local shards. Layers of other pipeline stages are never read. A
value or reward head's output layer (replicated) is a classifier checkpoint's ``score`` layer,
or keeps the engine's own initialisation: an LM checkpoint's ``lm_head`` is not loaded into it.
"""

from __future__ import annotations

import torch

from strategies.backends.megatron.hf.adapters import adapter_for
from strategies.backends.megatron.model import ReplicatedOutputLayer
from strategies.backends.megatron.weight_init import TensorParallelLayout, global_parameters
from strategies.hf.classification import HeadLayer, score_name
from strategies.hf.files import SafetensorsCheckpoint
from strategies.part_configs import ModelConfig


def load_hf_weights(chunk: torch.nn.Module, config: ModelConfig, head_layer: HeadLayer) -> None:
    """Copy the checkpoint at ``config.hf_path`` into ``chunk`` (this rank's stage, experts and
    TP shard; the head's own layer where ``head_layer`` says the checkpoint holds it)."""
    assert config.hf_path is not None
    adapter = adapter_for(config)
    value_head = isinstance(getattr(chunk, "output_layer", None), ReplicatedOutputLayer)
    local_names = [name for name, _ in chunk.named_parameters()]
    with torch.no_grad(), SafetensorsCheckpoint(config.hf_path) as checkpoint:
        for local_name, (name, param) in zip(local_names, global_parameters(chunk), strict=True):
            if value_head and local_name.startswith("output_layer."):
                if head_layer.from_checkpoint:  # replicated: every rank holds all of it
                    score = checkpoint.read(score_name(local_name), param.shape)
                    param.copy_(score.to(dtype=param.dtype, device=param.device))
                continue
            layout = TensorParallelLayout.of(name, param)
            expected = adapter.to_hf(name, torch.empty(layout.full_shape, device="meta"))
            full = adapter.to_megatron(
                name, [checkpoint.read(hf_name, shape.shape) for hf_name, shape in expected]
            )
            param.copy_(layout.shard(full).to(dtype=param.dtype, device=param.device))
