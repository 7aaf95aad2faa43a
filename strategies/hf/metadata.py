"""What is written next to exported Hugging Face weights: config.json, the shard index, and
the source checkpoint's tokenizer and generation files."""

from __future__ import annotations

import json
import os
import shutil

from strategies.hf.architecture import hf_config_for
from strategies.hf.classification import HeadLayer, exported_config
from strategies.hf.files import INDEX_FILE
from strategies.part_configs import ModelConfig

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def write_hf_metadata(
    model: ModelConfig, layer: HeadLayer, staging: str, weight_map: dict[str, str], stages: int
) -> None:
    """config.json (the source checkpoint's, or the one ``model`` describes, as the config of
    the causal LM or classifier ``layer`` makes it), the shard index when there are several
    files, and the source's tokenizer and generation files, into ``staging``."""
    exported_config(hf_config_for(model), layer).save_pretrained(staging)
    if stages > 1:
        with open(os.path.join(staging, INDEX_FILE), "w") as handle:
            json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, handle)
    if model.hf_path is not None:
        _copy_tokenizer_files(model.hf_path, staging)


def _copy_tokenizer_files(source: str, staging: str) -> None:
    """The source's tokenizer and generation settings travel along (its weights do not)."""
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if os.path.isfile(path) and name != "config.json" and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(staging, name))
