"""Write the model as a Hugging Face checkpoint that ``AutoModelForCausalLM`` loads.

Every rank takes part (tensor-parallel shards are all-gathered); one rank per pipeline stage
writes that stage's safetensors file into a temporary sibling directory, and global rank 0 adds
the index, ``config.json`` (and the source checkpoint's tokenizer files) and renames it into
place, so a reader never sees a half-written checkpoint. With several pipeline stages the
directory must be on a filesystem all writing ranks share.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable

import torch
import torch.distributed as dist

from heads.errors import CheckpointError, ConfigError
from strategies.backends.megatron.hf.config import load_hf_config
from strategies.backends.megatron.hf.export import export_hf
from strategies.backends.megatron.hf.loading import INDEX_FILE, SINGLE_FILE
from strategies.config import ModelConfig

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def save_hf(chunks: Iterable[torch.nn.Module], config: ModelConfig, directory: str) -> None:
    """Save ``chunks`` (this rank's part of the model) as an HF checkpoint in ``directory``."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    if config.hf_path is None:
        raise ConfigError(
            "save_hf needs ModelConfig.hf_path: the source checkpoint's config.json is what it "
            "writes next to the weights"
        )
    directory = os.path.abspath(directory)
    staging = directory + ".saving"
    stages = ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    writer = writer and ps.get_context_parallel_rank() == 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    _barrier()
    file = SINGLE_FILE if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
    tensors = {name: t.contiguous() for chunk in chunks for name, t in export_hf(chunk, config)}
    if writer:
        save_file(tensors, os.path.join(staging, file), metadata={"format": "pt"})
    names = dict.fromkeys(tensors, file) if writer else {}
    weight_map = _gather_dicts(names)
    if rank == 0:
        _write_metadata(config.hf_path, staging, weight_map, stages)
        _replace_directory(staging, directory)
    _barrier()


def _write_metadata(source: str, staging: str, weight_map: dict[str, str], stages: int) -> None:
    hf = load_hf_config(source)
    hf.save_pretrained(staging)
    if stages > 1:
        with open(os.path.join(staging, INDEX_FILE), "w") as handle:
            json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, handle)
    for name in os.listdir(source):  # tokenizer and generation settings travel along
        path = os.path.join(source, name)
        if os.path.isfile(path) and name != "config.json" and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(staging, name))


def _replace_directory(staging: str, directory: str) -> None:
    previous = directory + ".previous"
    try:
        if os.path.exists(directory):
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(directory, previous)
        os.rename(staging, directory)
        shutil.rmtree(previous, ignore_errors=True)
    except OSError as error:
        raise CheckpointError(f"cannot move the checkpoint to {directory}: {error}") from error


def _gather_dicts(local: dict[str, str]) -> dict[str, str]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    gathered: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    return {name: file for part in gathered for name, file in part.items()}


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
