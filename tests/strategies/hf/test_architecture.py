"""A ModelConfig's Hugging Face config describes the same model: written out and parsed back it
gives the ModelConfig again, for each architecture the description can ask for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from heads.errors import CheckpointError, ConfigError
from strategies.hf.architecture import hf_config_for
from strategies.hf.config_json import model_config_from_hf
from strategies.part_configs import MODEL_PRESETS, ModelConfig

TINY = attrs.asdict(MODEL_PRESETS["tiny"])
CASES: dict[str, dict[str, Any]] = {
    "llama-tiny": TINY,
    "llama-tied": {**TINY, "tie_embeddings": True, "rotary_base": 500000},
    "llama3-rope": {**TINY, "rope_scaling_factor": 8.0, "max_sequence_length": 131072},
    "qwen2": {**TINY, "add_qkv_bias": True, "tie_embeddings": True},
    "qwen3": {**TINY, "qk_layernorm": True, "head_dim": 32},
}


def save_model(model: ModelConfig, directory: Path) -> None:
    """A random transformers model of ``model``'s description, weights and config."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(hf_config_for(model)).save_pretrained(directory)


@pytest.mark.parametrize("fields", CASES.values(), ids=list(CASES))
def test_a_model_config_round_trips_through_its_hugging_face_config(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    model = ModelConfig(**fields)
    save_model(model, tmp_path)
    parsed = model_config_from_hf(tmp_path)
    assert attrs.evolve(parsed, hf_path=None, checkpoint_dtype=None) == model


def test_a_checkpoint_model_gets_the_checkpoints_own_config(tmp_path: Path) -> None:
    save_model(ModelConfig(add_qkv_bias=True), tmp_path)
    parsed = model_config_from_hf(tmp_path)
    assert hf_config_for(parsed).architectures == ["Qwen2ForCausalLM"]


def test_qkv_biases_with_qk_norms_match_no_architecture() -> None:
    with pytest.raises(ConfigError, match="add_qkv_bias and qk_layernorm"):
        hf_config_for(ModelConfig(add_qkv_bias=True, qk_layernorm=True))


def test_a_preset_name_is_the_preset_unless_a_checkpoint_of_that_name_makes_it_ambiguous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model: moe`` where a directory ``moe`` (an earlier run's output, say) is in the way is
    still the preset; a Hugging Face checkpoint named like a preset is refused naming both, and
    ``./moe`` is the checkpoint."""
    from engine.config import EngineConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "moe").mkdir()
    assert EngineConfig.from_dict({"model": "moe"}).model == MODEL_PRESETS["moe"]
    save_model(ModelConfig(add_qkv_bias=True), tmp_path / "moe")
    with pytest.raises(ConfigError, match="both a preset and a Hugging Face checkpoint"):
        EngineConfig.from_dict({"model": "moe"})
    assert EngineConfig.from_dict({"model": "./moe"}).model.add_qkv_bias
    (tmp_path / "mine").mkdir()  # not a preset: read as a checkpoint, which it is not
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        EngineConfig.from_dict({"model": "mine"})
