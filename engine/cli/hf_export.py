"""The final model of a command-line run as a Hugging Face directory (``Engine.save_hf``, LoRA
merged), so that a run ends with something transformers, vLLM or a next stage loads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from heads.errors import ConfigError

if TYPE_CHECKING:
    from engine import Engine

#: Under the run's output directory.
HF_DIR = "huggingface"


def export_final_model(engine: Engine, directory: Path, name: str) -> str:
    """Save ``engine`` to ``directory`` with ``save_hf`` (collective: every rank calls it) and
    say where; where ``save_hf`` refuses the engine (a head or model it cannot write), say why
    instead, without failing the run: its checkpoints still hold the model."""
    try:
        engine.save_hf(directory)
    except ConfigError as error:
        return f"{name} not exported as a Hugging Face directory: {error}"
    return f"{name} as a Hugging Face directory in {directory}"
