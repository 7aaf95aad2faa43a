"""What is written next to exported Hugging Face weights: config.json, the shard index, and
the source checkpoint's tokenizer and generation files."""

from __future__ import annotations

import json
import os
import shutil

from strategies.hf.config import load_hf_config
from strategies.hf.files import INDEX_FILE

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def write_hf_metadata(source: str, staging: str, weight_map: dict[str, str], stages: int) -> None:
    """config.json (from ``source``), the shard index when there are several files, and the
    source's tokenizer and generation files, into ``staging``."""
    hf = load_hf_config(source)
    hf.save_pretrained(staging)
    if stages > 1:
        with open(os.path.join(staging, INDEX_FILE), "w") as handle:
            json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, handle)
    for name in os.listdir(source):  # tokenizer and generation settings travel along
        path = os.path.join(source, name)
        if os.path.isfile(path) and name != "config.json" and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(staging, name))
