"""Write the model as a Hugging Face checkpoint that transformers loads: ``AutoModelForCausalLM``,
or a value or reward head's ``AutoModelForTokenClassification`` /
``AutoModelForSequenceClassification`` (``strategies.hf.classification``).

Every rank takes part (tensor-parallel shards are all-gathered); one rank per pipeline stage
writes that stage's safetensors file into a temporary sibling directory, and global rank 0 adds
the index, ``config.json`` (and the source checkpoint's tokenizer files) and renames it into
place, so a reader never sees a half-written checkpoint. With several pipeline stages the
directory must be on a filesystem all writing ranks share.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

import torch

from strategies.backends.megatron.hf.export import export_hf
from strategies.checkpoint_files.publish import publish_directory
from strategies.hf.classification import TOKEN_CLASSIFICATION, HeadLayer, with_score_bias
from strategies.hf.files import SINGLE_FILE
from strategies.hf.metadata import write_hf_metadata
from strategies.parallel.collectives import barrier, merged_dicts, rank
from strategies.part_configs import ModelConfig, PartsConfig


def save_hf(
    chunks: Iterable[torch.nn.Module],
    config: ModelConfig,
    layer: HeadLayer,
    directory: str,
    parts: PartsConfig | None = None,
) -> None:
    """Save ``chunks`` (this rank's part of the model) as an HF checkpoint in ``directory``, a
    causal LM or the classifier ``layer`` makes it (LoRA adapters merged into their linears,
    see ``export_hf``)."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    task = layer.export_task()
    directory = os.path.abspath(directory)
    staging = directory + ".saving"
    stages = ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    writer = writer and ps.get_context_parallel_rank() == 0
    if rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    barrier()
    file = SINGLE_FILE if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
    tensors = {
        name: t.contiguous() for chunk in chunks for name, t in export_hf(chunk, config, parts)
    }
    if task == TOKEN_CLASSIFICATION:
        tensors = with_score_bias(tensors)
    if writer:
        save_file(tensors, os.path.join(staging, file), metadata={"format": "pt"})
    names = dict.fromkeys(tensors, file) if writer else {}
    weight_map = merged_dicts(names)
    if rank() == 0:
        write_hf_metadata(config, layer, staging, weight_map, stages)
        publish_directory(staging, directory)
    barrier()
