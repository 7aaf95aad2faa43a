"""A Hugging Face checkpoint must hold exactly the tensors of the model its config describes:
a causal LM, or a classifier (its body and a ``score`` layer instead of ``lm_head``)."""

from __future__ import annotations

import os
from typing import Any

import torch

from heads.errors import CheckpointError
from strategies.hf.classification import SCORE_WEIGHT, ScoreLayer, read_score_layer
from strategies.hf.experts import CheckpointLayout
from strategies.hf.files import INDEX_FILE, SafetensorsCheckpoint

#: Tensors a checkpoint may hold that no model parameter takes, known to be harmless.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
_LM_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def check_checkpoint_tensors(path: str, hf_config: Any) -> ScoreLayer | None:
    """The checkpoint at ``path`` holds exactly the tensors of the causal LM ``hf_config``
    describes (as transformers builds it), or of its classifier (``score`` instead of
    ``lm_head``; returned): each one its index names is in that file, none is missing, and none
    is left over except known-harmless ones (rotary ``inv_freq``; an ``lm_head`` equal to the
    tied embedding). CheckpointError naming the tensors otherwise.

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
        score = read_score_layer(checkpoint, hf_config)
        if score is not None:
            if _LM_HEAD in found:
                raise CheckpointError(
                    f"the checkpoint {path} holds both a causal LM's {_LM_HEAD} and a "
                    f"classifier's {SCORE_WEIGHT}; remove the one its model does not use"
                )
            expected = (expected - {_LM_HEAD}) | score.names
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
    return score


def _parameter_names(hf_config: Any) -> set[str]:
    """The checkpoint tensor names of the causal LM transformers builds from ``hf_config`` (on
    the meta device: nothing is allocated), as ``save_pretrained`` writes them (one tensor per
    expert projection, where transformers fuses a layer's experts in memory). A tied
    ``lm_head`` is not a separate tensor."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    layout = CheckpointLayout(getattr(hf_config, "model_type", None))
    names = {
        stored
        for name, tensor in model.state_dict(keep_vars=True).items()
        for stored in layout.names(name, tensor.shape)
    }
    return names - ({_LM_HEAD} if getattr(hf_config, "tie_word_embeddings", False) else set())


def _listed(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
