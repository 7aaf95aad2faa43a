"""Hugging Face checkpoints: every supported family loads with logits parity, exports back
bit-exactly, survives a training step, and bad checkpoints fail naming the tensor or field.

The reference is transformers itself, on tiny random models built from config objects and saved
with ``save_pretrained`` (no network). Log-probs are compared in float32 (max |diff| <= 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from heads.errors import CheckpointError, ConfigError
from tests.factories import random_batch
from tests.multiprocess import run_ranks

TOLERANCE = 1e-5
LENGTHS = [7, 12, 5, 9]
VOCAB = 128


def _rope(theta: float, **scaling: Any) -> dict[str, Any]:
    """Rope settings as the installed transformers spells them (5.x: ``rope_parameters``)."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **scaling}}
    return {"rope_theta": theta, "rope_scaling": scaling or None}


_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_config(family: str) -> Any:
    """A tiny transformers config of ``family`` (GQA everywhere: 4 heads, 2 key/value heads)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
    }
    if family == "llama":
        return transformers.LlamaConfig(**common, **_rope(10000.0))
    if family == "llama3.1":
        common["max_position_embeddings"] = 131072
        return transformers.LlamaConfig(**common, **_rope(500000.0, **_LLAMA3))
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, **_rope(1e6))
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, **_rope(1e6))
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, **_rope(10000.0))
    raise AssertionError(family)


def save_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """A random model of ``family`` saved to ``directory`` (every weight random, norms ~1)."""
    return save_random_model(hf_config(family), directory, seed)


def save_random_model(config: Any, directory: Path, seed: int = 0, task: str = "CausalLM") -> Path:
    """The model of the transformers ``config`` for ``task`` (``AutoModelFor<task>``: a causal
    LM, or a token or sequence classifier) with random weights (norms ~1, biases ~0.1), saved."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, f"AutoModelFor{task}").from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param) * (0.1 if param.dim() == 1 else 0.05)
            param.copy_(noise + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    return directory


def hf_log_probs(path: Path, tokens: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log p(x_t | x_<t) for t >= 1 of each sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    result = []
    with torch.no_grad():
        for sequence in tokens:
            ids = torch.tensor([sequence])
            logits = model(ids).logits[0, :-1].float()
            result.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0])
    return result


def engine_log_probs(engine: Any, batch: Any) -> list[torch.Tensor] | None:
    output = engine.infer_batch(batch)
    if output is None:
        return None
    return [row[1:].float() for row in output["log_probs"].unbind()]


def max_diff(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))


def token_lists(batch: Any) -> list[list[int]]:
    return [row.tolist() for row in batch["input_ids"].unbind()]


def build_engine(path: Path | str, head: str = "lm", **extra: Any) -> Any:
    from engine import Engine

    config = {"model": str(path), "micro_batch_size": 2, "forward_only": True, **extra}
    return Engine.build(head=head, device="cpu", config=config).initialize()


def source_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    families = ("llama", "llama3.1", "qwen2", "qwen3", "mistral")
    return {family: save_checkpoint(family, root / family) for family in families}


@pytest.mark.parametrize("family", ["llama", "llama3.1", "qwen2", "qwen3", "mistral"])
def test_engine_log_probs_match_transformers_and_export_is_the_source(
    fresh_mesh: None, checkpoints: dict[str, Path], family: str
) -> None:
    batch = random_batch(LENGTHS, VOCAB, seed=1)
    engine = build_engine(checkpoints[family])
    got = engine_log_probs(engine, batch)
    assert got is not None
    diff = max_diff(got, hf_log_probs(checkpoints[family], token_lists(batch)))
    print(f"{family}: max |engine - transformers| log-prob = {diff:.2e}")
    assert diff <= TOLERANCE
    exported = dict(engine.get_per_tensor_param())
    source = source_state_dict(checkpoints[family])
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[name], source[name]) for name in source)


def test_qkv_in_the_wrong_order_is_caught_by_the_comparison(
    fresh_mesh: None, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from strategies.backends.megatron.hf import adapters

    def ungrouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> Any:
        return torch.cat([q, k, v])

    monkeypatch.setattr(adapters, "fuse_qkv", ungrouped)
    batch = random_batch(LENGTHS, VOCAB, seed=1)
    got = engine_log_probs(build_engine(checkpoints["llama"]), batch)
    assert got is not None
    assert max_diff(got, hf_log_probs(checkpoints["llama"], token_lists(batch))) > 1e-3


def test_after_a_training_step_transformers_reloads_what_the_engine_saved(
    fresh_mesh: None, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from engine.losses import sft_loss

    source = checkpoints["qwen2"]
    engine = build_engine(source, forward_only=False, optimizer={"lr": 1e-2})
    batch = random_batch(LENGTHS, VOCAB, seed=2)
    before = engine_log_probs(engine, batch)
    with engine.train_mode():
        engine.train_batch(batch, sft_loss)
    after = engine_log_probs(engine, batch)
    assert before is not None and after is not None
    assert max_diff(after, before) > 1e-3  # the step changed the model
    engine.save_hf(tmp_path / "saved")
    diff = max_diff(after, hf_log_probs(tmp_path / "saved", token_lists(batch)))
    print(f"after one step: max |engine - reloaded transformers| log-prob = {diff:.2e}")
    assert diff <= TOLERANCE
    assert not (tmp_path / "saved.saving").exists()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_value_head_from_an_lm_checkpoint_keeps_its_own_init(
    fresh_mesh: None, checkpoints: dict[str, Path], family: str
) -> None:
    import attrs

    from strategies.backends.megatron.mesh import destroy_mesh

    loaded = dict(build_engine(checkpoints[family], head="value").get_per_tensor_param())
    source = source_state_dict(checkpoints[family])
    assert "lm_head.weight" not in loaded
    assert all(
        torch.equal(loaded[name], source[name]) for name in source if name != "lm_head.weight"
    )
    destroy_mesh()
    from strategies.hf.config_json import model_config_from_hf

    fresh = attrs.evolve(model_config_from_hf(checkpoints[family]), hf_path=None)
    scratch = dict(build_engine("", head="value", model=fresh).get_per_tensor_param())
    assert torch.equal(loaded["score.weight"], scratch["score.weight"])


# -- bad checkpoints ---------------------------------------------------------------------------
def _edit_config(path: Path, **changes: Any) -> None:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


def _copy(checkpoints: dict[str, Path], family: str, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(checkpoints[family], tmp_path / family))


def test_a_missing_weights_file_names_the_directory(
    fresh_mesh: None, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = _copy(checkpoints, "llama", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"holds no model\.safetensors"):
        build_engine(path)


def test_a_missing_shard_file_is_named(
    fresh_mesh: None, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = _copy(checkpoints, "llama", tmp_path)
    weight_map = dict.fromkeys(source_state_dict(path), "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00001-of-00001\.safetensors is missing"):
        build_engine(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop", r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"),
        ("reshape", r"'model\.layers\.1\.mlp\.up_proj\.weight' .* shape \[48, 64\].* \[96, 64\]"),
    ],
)
def test_a_missing_or_misshapen_tensor_is_named_with_both_shapes(
    fresh_mesh: None, checkpoints: dict[str, Path], tmp_path: Path, change: str, message: str
) -> None:
    from safetensors.torch import save_file

    path = _copy(checkpoints, "llama", tmp_path)
    tensors = source_state_dict(path)
    name = "model.layers.1.mlp.up_proj.weight"
    if change == "drop":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:48].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        build_engine(path)


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        ("llama", {"model_type": "gpt2"}, "model_type"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rope_type",
        ),
        (
            "llama3.1",
            {"rope_parameters": {**_LLAMA3, "rope_theta": 5e5, "high_freq_factor": 2.0}},
            "high_freq_factor",
        ),
        ("mistral", {"sliding_window": 16}, "sliding_window"),
        ("llama", {"attention_bias": True}, "attention_bias"),
    ],
    ids=["model-type", "rope-type", "llama3-factors", "sliding-window", "attention-bias"],
)
def test_an_unsupported_config_is_refused_naming_the_field(
    checkpoints: dict[str, Path], tmp_path: Path, family: str, changes: Any, field: str
) -> None:
    from strategies.hf.config_json import model_config_from_hf

    path = _copy(checkpoints, family, tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(ConfigError, match=field):
        model_config_from_hf(path)


# -- tensor and pipeline parallel ---------------------------------------------------------------
def load_on_ranks(paths: list[str], parallel: dict[str, int]) -> dict[str, Any]:
    """On every rank: each checkpoint's log-probs (output ranks) and this rank's export."""
    from megatron.core import parallel_state as ps

    report: dict[str, Any] = {}
    batch = random_batch(LENGTHS, VOCAB, seed=1)
    for path in paths:
        engine = build_engine(path, parallel=parallel)
        report[path] = {
            "log_probs": engine_log_probs(engine, batch),
            "export": dict(engine.get_per_tensor_param()),
        }
    report["tp"] = ps.get_tensor_model_parallel_rank()
    return report


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
    ids=["tp2", "pp2"],
)
def test_two_process_layouts_load_with_parity(
    checkpoints: dict[str, Path], parallel: dict[str, int]
) -> None:
    paths = [str(checkpoints["llama"]), str(checkpoints["qwen2"])]
    reports = run_ranks(load_on_ranks, 2, paths, parallel, timeout=240)
    batch = random_batch(LENGTHS, VOCAB, seed=1)
    for path in paths:
        expected = hf_log_probs(Path(path), token_lists(batch))
        outputs = [r[path]["log_probs"] for r in reports if r[path]["log_probs"] is not None]
        assert outputs
        for got in outputs:
            diff = max_diff(got, expected)
            print(f"{parallel} {Path(path).name}: max |engine - transformers| = {diff:.2e}")
            assert diff <= TOLERANCE
        source = source_state_dict(Path(path))
        exports = [r[path]["export"] for r in reports]
        if "tensor_parallel_size" in parallel:  # every TP rank yields the whole model
            assert all(sorted(e) == sorted(source) for e in exports)
        else:  # each stage yields its own layers; together, the whole model
            assert sorted(exports[0].keys() | exports[1].keys()) == sorted(source)
        for export in exports:
            assert all(torch.equal(tensor, source[name]) for name, tensor in export.items())


@pytest.mark.parametrize(
    ("field", "value"),
    [("head_dim", 0), ("rope_scaling_factor", -1.0), ("add_qkv_bias", 1), ("hf_path", 3)],
)
def test_new_model_fields_are_validated_naming_the_field(field: str, value: Any) -> None:
    from strategies.part_configs import ModelConfig

    with pytest.raises(ConfigError, match=f"ModelConfig.{field}"):
        ModelConfig(**{field: value})


# -- a checkpoint must be the model its config describes ---------------------------------------
def _rewrite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_a_tensor_no_parameter_takes_is_refused_naming_it(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from strategies.hf.config_json import model_config_from_hf

    path = _copy(checkpoints, "llama", tmp_path)
    tensors = source_state_dict(path)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # harmless
    _rewrite(path, tensors)
    with pytest.raises(CheckpointError, match=r"does not use: 'model\.layers\.0\.self_attn\.q_pr"):
        model_config_from_hf(path)
    del tensors["model.layers.0.self_attn.q_proj.bias"]
    _rewrite(path, tensors)
    assert model_config_from_hf(path).hf_path == str(path)


def test_the_family_follows_model_type_as_transformers_does(
    fresh_mesh: None, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from strategies.hf.config_json import model_config_from_hf

    mislabelled = _copy(checkpoints, "qwen2", tmp_path)
    _edit_config(mislabelled, architectures=["LlamaForCausalLM"])  # model_type stays qwen2
    assert model_config_from_hf(mislabelled).add_qkv_bias
    batch = random_batch(LENGTHS, VOCAB, seed=2)
    got = engine_log_probs(build_engine(mislabelled), batch)
    tokens = [row.tolist() for row in batch["input_ids"].unbind()]
    assert got is not None and max_diff(got, hf_log_probs(mislabelled, tokens)) <= TOLERANCE

    llama_typed = tmp_path / "llama-typed"
    llama_typed.mkdir()
    for name in ("config.json", "model.safetensors"):
        (llama_typed / name).write_bytes((mislabelled / name).read_bytes())
    _edit_config(llama_typed, model_type="llama")  # a Llama has no q/k/v biases
    with pytest.raises(CheckpointError, match=r"does not use: .*q_proj\.bias"):
        model_config_from_hf(llama_typed)


def test_a_tied_config_with_a_different_lm_head_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from strategies.hf.config_json import model_config_from_hf

    path = _copy(checkpoints, "qwen2", tmp_path)  # tie_word_embeddings=True
    tensors = source_state_dict(path)
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding.clone()
    _rewrite(path, tensors)
    assert model_config_from_hf(path).tie_embeddings  # an equal copy is harmless
    tensors["lm_head.weight"] = embedding + 0.5
    _rewrite(path, tensors)
    with pytest.raises(CheckpointError, match=r"ties the embeddings .* lm_head\.weight differs"):
        model_config_from_hf(path)


def test_an_index_that_maps_a_tensor_to_the_wrong_shard_is_refused_naming_both(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    from strategies.hf.config_json import model_config_from_hf

    path = _copy(checkpoints, "llama", tmp_path)
    tensors = source_state_dict(path)
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(path / file), metadata={"format": "pt"})
    (path / "model.safetensors").unlink()
    weight_map = {name: file for file, members in shards.items() for name in members}
    moved = shards["b.safetensors"][0]
    weight_map[moved] = "a.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"maps '{moved}' to a\.safetensors"):
        model_config_from_hf(path)


def test_a_bf16_checkpoint_is_exported_in_bf16_as_it_was_loaded(
    fresh_mesh: None, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], local_files_only=True)
    path = tmp_path / "bf16"
    source.to(torch.bfloat16).save_pretrained(path)
    assert json.loads((path / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    engine = build_engine(path)
    assert engine.config.model.checkpoint_dtype == "bfloat16"
    exported = dict(engine.get_per_tensor_param())
    saved = source_state_dict(path)
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert exported[name].dtype == torch.bfloat16, name
        assert torch.equal(exported[name], tensor), name
    engine.save_hf(tmp_path / "exported")
    again = source_state_dict(tmp_path / "exported")
    assert all(again[name].dtype == torch.bfloat16 for name in again)
