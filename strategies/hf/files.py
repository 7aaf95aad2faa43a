"""Hugging Face checkpoint files: the safetensors reader (single file or sharded index) and the
metadata written next to exported weights."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any

import torch

from heads.errors import CheckpointError
from strategies.hf.config import load_hf_config

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
