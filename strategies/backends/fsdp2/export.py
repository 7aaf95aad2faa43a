"""The model as Hugging Face tensors, one full tensor at a time, and as a checkpoint that
``AutoModelForCausalLM`` loads.

Parameters already carry Hugging Face names; each sharded parameter is all-gathered on its own
(``DTensor.full_tensor``), so no rank ever holds more than one full tensor for export. Collective:
every rank walks the parameters in the same order. A value head's layer is yielded as
``value_head.weight`` (megatron's export name too). Experts that transformers fuses in memory
are yielded per expert, under the names its checkpoints use.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import torch

from strategies.config import ModelConfig
from strategies.distributed import barrier, rank
from strategies.hf.architecture import hf_config_for
from strategies.hf.experts import CheckpointLayout
from strategies.hf.files import SINGLE_FILE
from strategies.hf.metadata import write_hf_metadata
from strategies.publish import publish_directory


def export_hf(model: torch.nn.Module, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) for every parameter (a tied ``lm_head`` once, as the
    embedding; fused experts one tensor per expert projection), each a tensor of its own."""
    from torch.distributed.tensor import DTensor

    layout = CheckpointLayout.of(config)
    for name, param in model.named_parameters():
        held = param.detach()
        shard = held.to_local() if isinstance(held, DTensor) else held
        full = held.full_tensor() if isinstance(held, DTensor) else held
        if full.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr():
            full = full.clone()  # a world of one may hand back the parameter's own storage
        yield from layout.split(name, full)


def save_hf(model: torch.nn.Module, config: ModelConfig, directory: str) -> None:
    """Write the model as a Hugging Face checkpoint in ``directory``: rank 0 gathers the
    tensors, writes safetensors and ``config.json`` (the source checkpoint's, with its tokenizer
    files, or the one the ModelConfig describes) into a temporary sibling and renames it."""
    from safetensors.torch import save_file

    directory = os.path.abspath(directory)
    staging = directory + ".saving"
    writer = rank() == 0
    if writer:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    tensors = {name: tensor.contiguous() for name, tensor in export_hf(model, config) if writer}
    if writer:
        save_file(tensors, os.path.join(staging, SINGLE_FILE), metadata={"format": "pt"})
        if config.hf_path is not None:
            write_hf_metadata(config.hf_path, staging, {}, 1)
        else:
            hf_config_for(config).save_pretrained(staging)
        publish_directory(staging, directory)
    barrier()
