"""Mixture-of-experts Hugging Face checkpoints (Qwen3-MoE, Mixtral) on both backends: log-probs
equal transformers', the backends agree, export gives back the checkpoint's own tensors under
its per-expert names, expert parallelism loads and exports every expert, and what the engine
would compute differently is refused naming the field.

Tiny random models (4 experts, top-2, 2 layers, hidden 64) saved with ``save_pretrained``, so
the names on disk are the ones transformers writes even where it fuses experts in memory.
Engines are built once per module. Measured here (float32, 4 sequences of 5-12 tokens), all
checked against 1e-4: engine vs transformers 4.8e-7 (Qwen3-MoE and Mixtral, both backends),
megatron vs fsdp2 4.8e-7, and 9.5e-7 after one AdamW step (lr 1e-2); expert parallel 2 vs
transformers 4.8e-7. Swapping each expert's gate and up projections moves the log-probs by
3.6e-2 (Qwen3-MoE) and 5.4e-2 (Mixtral), so the comparison does fail when the mapping is wrong.
The file also passes on transformers 5.10.4 (fused experts, as 5.24) and 4.56.2 (experts held
under the checkpoint names; 9.5e-6 after the AdamW step).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from heads.errors import CheckpointError, ConfigError
from tests.factories import random_batch
from tests.multiprocess import run_ranks
from tests.strategies.backends.megatron.test_hf import (
    VOCAB,
    _rope,
    engine_log_probs,
    hf_log_probs,
    max_diff,
    save_random_model,
    source_state_dict,
    token_lists,
)

TOLERANCE = 1e-4
LENGTHS = [7, 12, 5, 9]
FAMILIES = ("qwen3_moe", "mixtral")
BACKENDS = ("megatron", "fsdp2")


def hf_config(family: str) -> Any:
    """A tiny transformers MoE config of ``family``: 4 experts, 2 per token, GQA."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "num_experts_per_tok": 2,
    }
    if family == "qwen3_moe":  # top-k scores not renormalised (megatron: softmax before top-k)
        return transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            norm_topk_prob=False,
            head_dim=32,
            **_rope(1e6),
        )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **common, intermediate_size=48, num_local_experts=4, **_rope(1e6)
        )
    raise AssertionError(family)


def save_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """A random model of ``family`` saved to ``directory`` (every weight random, norms ~1)."""
    return save_random_model(hf_config(family), directory, seed)


def build_engine(path: Path | str, backend: str = "megatron", **extra: Any) -> Any:
    from engine import Engine

    config = {"model": str(path), "micro_batch_size": 2, "forward_only": True, **extra}
    return Engine.build(head="lm", backend=backend, device="cpu", config=config).initialize()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {family: save_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def engines(checkpoints: dict[str, Path]) -> Iterator[dict[tuple[str, str], Any]]:
    """A forward-only engine per (family, backend), built once."""
    from strategies.backends.megatron.mesh import destroy_mesh

    destroy_mesh()
    yield {
        (family, backend): build_engine(checkpoints[family], backend)
        for family in FAMILIES
        for backend in BACKENDS
    }
    destroy_mesh()


@pytest.fixture(scope="module")
def batch() -> Any:
    return random_batch(LENGTHS, VOCAB, seed=1)


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path], batch: Any) -> dict[str, list[torch.Tensor]]:
    """transformers' log-probs of each checkpoint."""
    return {family: hf_log_probs(checkpoints[family], token_lists(batch)) for family in FAMILIES}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_log_probs_match_transformers(
    engines: dict[tuple[str, str], Any],
    expected: dict[str, list[torch.Tensor]],
    batch: Any,
    family: str,
    backend: str,
) -> None:
    got = engine_log_probs(engines[family, backend], batch)
    assert got is not None
    diff = max_diff(got, expected[family])
    print(f"{family} on {backend}: max |engine - transformers| log-prob = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_the_backends_agree(engines: dict[tuple[str, str], Any], batch: Any, family: str) -> None:
    megatron, fsdp2 = (engine_log_probs(engines[family, b], batch) for b in BACKENDS)
    assert megatron is not None and fsdp2 is not None
    diff = max_diff(megatron, fsdp2)
    print(f"{family}: max |megatron - fsdp2| log-prob = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_export_is_the_checkpoint_under_its_own_names(
    engines: dict[tuple[str, str], Any],
    checkpoints: dict[str, Path],
    tmp_path: Path,
    family: str,
    backend: str,
) -> None:
    engine = engines[family, backend]
    source = source_state_dict(checkpoints[family])
    exported = dict(engine.get_per_tensor_param())
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[name], source[name]) for name in source)
    engine.save_hf(tmp_path / "saved")
    saved = source_state_dict(tmp_path / "saved")
    assert saved.keys() == source.keys()
    assert all(torch.equal(saved[name], source[name]) for name in source)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    original = json.loads((checkpoints[family] / "config.json").read_text())
    assert config["model_type"] == family
    assert {k: v for k, v in config.items() if k != "transformers_version"} == {
        k: v for k, v in original.items() if k != "transformers_version"
    }


def test_a_training_step_agrees_across_backends(checkpoints: dict[str, Path], batch: Any) -> None:
    """Backward through transformers' MoE modules (fsdp2) and megatron's experts alike."""
    from engine.losses import sft_loss

    after = {}
    for backend in BACKENDS:
        engine = build_engine(
            checkpoints["qwen3_moe"], backend, forward_only=False, optimizer={"lr": 1e-2}
        )
        with engine.train_mode():
            engine.train_batch(batch, sft_loss)
        after[backend] = engine_log_probs(engine, batch)
    diff = max_diff(after["megatron"], after["fsdp2"])
    print(f"after one AdamW step: max |megatron - fsdp2| log-prob = {diff:.2e}")
    assert diff <= TOLERANCE


def test_a_model_from_scratch_saves_a_checkpoint_that_reads_back_alike(tmp_path: Path) -> None:
    """fsdp2 writes the config ``hf_config_for`` maps the ModelConfig to; reading that
    checkpoint back gives the same ModelConfig and, on megatron, the same log-probs."""
    from strategies.hf.config_json import model_config_from_hf
    from strategies.part_configs import model_preset

    model = attrs.evolve(model_preset("moe"), qk_layernorm=True, normalize_expert_weights=False)
    scratch = build_engine("", "fsdp2", model=model)
    scratch.save_hf(tmp_path / "scratch")
    names = source_state_dict(tmp_path / "scratch")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    read = model_config_from_hf(tmp_path / "scratch")
    assert attrs.evolve(read, hf_path=None, checkpoint_dtype=None) == model
    batch = random_batch(LENGTHS, VOCAB, seed=2)
    got = engine_log_probs(build_engine(tmp_path / "scratch"), batch)
    first = engine_log_probs(scratch, batch)
    assert got is not None and first is not None
    assert max_diff(got, first) <= TOLERANCE


# -- refusals ----------------------------------------------------------------------------------
def _edited(checkpoints: dict[str, Path], family: str, tmp_path: Path, **changes: Any) -> Path:
    path = Path(shutil.copytree(checkpoints[family], tmp_path / family))
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 32}, "shared_expert_intermediate_size"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ],
    ids=["mlp-only-layers", "sparse-step", "qwen-window", "shared-expert", "jitter", "window"],
)
def test_what_the_engine_computes_differently_is_refused_naming_the_field(
    checkpoints: dict[str, Path], tmp_path: Path, family: str, changes: Any, field: str
) -> None:
    from strategies.hf.config_json import model_config_from_hf

    with pytest.raises(ConfigError, match=f"config.json {field}"):
        model_config_from_hf(_edited(checkpoints, family, tmp_path, **changes))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_aux_loss_coefficient_is_taken_only_with_output_router_logits(
    checkpoints: dict[str, Path], tmp_path: Path, family: str
) -> None:
    from strategies.hf.config_json import model_config_from_hf

    model = model_config_from_hf(checkpoints[family])
    assert model.router_aux_loss_coeff == 0.0  # output_router_logits is false
    assert model.normalize_expert_weights == (family == "mixtral")
    assert (model.num_experts, model.experts_per_token) == (4, 2)
    changed = _edited(
        checkpoints, family, tmp_path, output_router_logits=True, router_aux_loss_coef=0.02
    )
    assert model_config_from_hf(changed).router_aux_loss_coeff == 0.02


def test_a_missing_expert_tensor_is_named(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from strategies.hf.config_json import model_config_from_hf

    path = Path(shutil.copytree(checkpoints["mixtral"], tmp_path / "mixtral"))
    tensors = source_state_dict(path)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.block_sparse_moe\.experts\.2"):
        model_config_from_hf(path)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"shared_expert_ffn_hidden_size": 32}, "shared_expert_ffn_hidden_size"),
        ({"router_score_function": "sigmoid"}, "router_score_function"),
        ({"normalize_expert_weights": False}, "normalize_expert_weights"),
        ({"add_qkv_bias": True}, "add_qkv_bias"),
    ],
)
def test_a_model_no_family_computes_is_refused_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    from strategies.hf.architecture import hf_config_for
    from strategies.part_configs import model_preset

    with pytest.raises(ConfigError, match=f"ModelConfig.{field}"):
        hf_config_for(attrs.evolve(model_preset("moe"), **changes))


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"parallel": {"expert_parallel_size": 2}}, "expert_parallel_size"),
        ({"router_replay": True}, "router_replay"),
        ({"model": {"shared_expert_ffn_hidden_size": 32}}, "shared_expert_ffn_hidden_size"),
        ({"model": {"router_score_function": "sigmoid"}}, "router_score_function"),
        ({"model": {"router_aux_loss_coeff": 0.01}}, "router_aux_loss_coeff"),
        ({"model": {"router_z_loss_coeff": 0.001}}, "router_z_loss_coeff"),
    ],
    ids=["expert-parallel", "router-replay", "shared-expert", "sigmoid", "aux-loss", "z-loss"],
)
def test_fsdp2_refuses_what_it_cannot_run_naming_the_field(
    config: dict[str, Any], field: str
) -> None:
    from engine import Engine
    from strategies.part_configs import model_preset

    model = attrs.evolve(model_preset("moe"), **config.pop("model", {}))
    with pytest.raises(ConfigError, match=field):
        Engine.build(head="lm", backend="fsdp2", device="cpu", config={"model": model, **config})


# -- expert parallelism ------------------------------------------------------------------------
def load_on_ranks(path: str) -> dict[str, Any]:
    """On every rank: with experts split over the ranks, and with each expert split over a
    tensor-parallel group (forward-only: training MoE under tensor parallelism needs sequence
    parallelism, which CPU hosts lack), the log-probs (output ranks) and the whole export."""
    from strategies.backends.megatron.mesh import destroy_mesh

    engine = build_engine(path, parallel={"expert_parallel_size": 2})
    report = {
        "log_probs": engine_log_probs(engine, random_batch(LENGTHS, VOCAB, seed=1)),
        "export": dict(engine.get_per_tensor_param()),
    }
    destroy_mesh()
    engine = build_engine(path, parallel={"tensor_parallel_size": 2})
    report["tp_log_probs"] = engine_log_probs(engine, random_batch(LENGTHS, VOCAB, seed=1))
    report["tp_export"] = dict(engine.get_per_tensor_param())
    return report


@pytest.mark.multiprocess
def test_expert_parallel_ranks_load_their_experts_and_export_every_one(
    checkpoints: dict[str, Path], expected: dict[str, list[torch.Tensor]]
) -> None:
    path = checkpoints["qwen3_moe"]
    reports = run_ranks(load_on_ranks, 2, str(path), timeout=240)
    source = source_state_dict(path)
    for report in reports:
        assert report["log_probs"] is not None
        diff = max_diff(report["log_probs"], expected["qwen3_moe"])
        print(f"expert parallel 2: max |engine - transformers| log-prob = {diff:.2e}")
        assert diff <= TOLERANCE
    tensor_parallel = [report["tp_log_probs"] for report in reports if report["tp_log_probs"]]
    assert len(tensor_parallel) == 1  # tensor-parallel rank 0 holds the outputs
    assert max_diff(tensor_parallel[0], expected["qwen3_moe"]) <= TOLERANCE
    for report in reports:
        for export in (report["export"], report["tp_export"]):
            assert sorted(export) == sorted(source)
            assert all(torch.equal(export[name], source[name]) for name in source)
