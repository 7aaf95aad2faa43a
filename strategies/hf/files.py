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


#: Tensors a checkpoint may hold that no model parameter takes, known to be harmless.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
_LM_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def check_checkpoint_tensors(path: str, hf_config: Any) -> None:
    """The checkpoint at ``path`` holds exactly the tensors of the causal LM ``hf_config``
    describes (as transformers builds it): each one its index names is in that file, none is
    missing, and none is left over except known-harmless ones (rotary ``inv_freq``; an
    ``lm_head`` equal to the tied embedding). CheckpointError naming the tensors otherwise.

    A tied config whose file holds a *different* ``lm_head`` is refused: the two readings
    (tie it, or use the file's) give different models.
    """
    expected = _parameter_names(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    with SafetensorsCheckpoint(path) as checkpoint:
        for file, held in checkpoint.names_in_files().items():
            misplaced = sorted(
                n for n, f in checkpoint.files.items() if f == file and n not in held
            )
            if misplaced:
                raise CheckpointError(
                    f"{os.path.join(path, INDEX_FILE)} maps {_listed(misplaced)} to {file}, "
                    "which does not hold them"
                )
        found = set(checkpoint.files)
        missing = sorted(expected - found)
        if missing:
            raise CheckpointError(
                f"tensor {missing[0]!r} is missing from the checkpoint {path} "
                f"({len(missing)} missing: {_listed(missing)})"
            )
        unused = sorted(name for name in found - expected if not name.endswith(_HARMLESS_SUFFIXES))
        if tied and _LM_HEAD in unused:
            unused.remove(_LM_HEAD)
            lm_head, embedding = (checkpoint.read_any(name) for name in (_LM_HEAD, _EMBEDDING))
            if not torch.equal(lm_head, embedding):
                raise CheckpointError(
                    f"{path}: config.json ties the embeddings (tie_word_embeddings=true) but the "
                    f"file's {_LM_HEAD} differs from {_EMBEDDING} (max difference "
                    f"{float((lm_head.float() - embedding.float()).abs().max()):.3g}); set "
                    "tie_word_embeddings to false to use the file's lm_head, or remove it"
                )
        if unused:
            raise CheckpointError(
                f"the checkpoint {path} holds tensors its config's model does not use: "
                f"{_listed(unused)} (does config.json's model_type match the weights?)"
            )


def _parameter_names(hf_config: Any) -> set[str]:
    """The parameter names of the causal LM transformers builds from ``hf_config`` (on the
    meta device: nothing is allocated). A tied ``lm_head`` is not a separate tensor."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return set(model.state_dict(keep_vars=True)) - (
        {_LM_HEAD} if getattr(hf_config, "tie_word_embeddings", False) else set()
    )


def _listed(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
