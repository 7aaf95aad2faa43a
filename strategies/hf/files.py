"""Hugging Face checkpoint files: the safetensors reader (a single file or a sharded index)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch

from heads.errors import CheckpointError

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
        where = os.path.join(self.path, file)
        try:
            found = tuple(handle.get_slice(name).get_shape())
        except Exception as error:  # safetensors raises its own untyped errors
            raise CheckpointError(
                f"cannot read tensor {name!r} from {where} (the file the index names for it): "
                f"{type(error).__name__}: {error}"
            ) from error
        if found != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {where} has shape {list(found)}; "
                f"the model config expects {list(shape)}"
            )
        try:
            tensor: torch.Tensor = handle.get_tensor(name)
        except Exception as error:
            raise CheckpointError(
                f"cannot read tensor {name!r} from {where}: {type(error).__name__}: {error}"
            ) from error
        return tensor

    def read_any(self, name: str) -> torch.Tensor:
        """The tensor ``name`` whatever its shape."""
        file = self.files[name]
        shape = self._open(file).get_slice(name).get_shape()
        return self.read(name, torch.Size(shape))

    def names_in_files(self) -> dict[str, set[str]]:
        """The tensor names each file really holds (its header only is read)."""
        return {file: set(self._open(file).keys()) for file in sorted(set(self.files.values()))}

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


def padding_token_id(path: str) -> int | None:
    """The checkpoint's pad token id (config.json ``pad_token_id``), or None where it has none
    or its pad token is the beginning-of-sequence token (a row may then start with it)."""
    try:
        with open(os.path.join(path, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    pad, bos = config.get("pad_token_id"), config.get("bos_token_id")
    return pad if isinstance(pad, int) and pad != bos else None
