"""LoRA (``EngineConfig.lora``) on both backends, one process.

One tiny random Qwen2 checkpoint (GQA, q/k/v biases, tied embeddings), adapters on q, v, o, up
and down (k and gate left out, so the fused qkv and [gate; up] weights mix adapted and plain
parts), rank 4, alpha 8, two AdamW steps at lr 1e-2. Measured here: megatron and fsdp2 agree
within 1e-6 on log-probs and adapters after the steps (checked against 1e-5); the PEFT adapter
loaded by peft onto transformers' model gives the engine's log-probs within 1e-6 (checked
against 1e-5). Exact (``torch.equal``): a new adapter changes no output, the base weights do
not move, ``disable_adapter()`` gives a fresh base engine's outputs, the merged export is
``W + (B @ A) * alpha / rank``, and a checkpoint resumes to the same adapters and optimizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine
from engine.losses import sft_loss
from heads.errors import CheckpointError, ConfigError, EngineStateError
from strategies.backends.megatron.mesh import destroy_mesh
from strategies.model.peft_lora import PEFT_PREFIX, adapter_delta
from tests.factories import random_batch, tiny_model
from tests.strategies.backends.megatron.test_hf import VOCAB, save_checkpoint

BACKENDS = ("megatron", "fsdp2")
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q", "v", "o", "up", "down"]}
SCALE = 8 / 4
ADAPTED = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
LENGTHS = [7, 12, 5, 9]
STEPS = 2
TOLERANCE = 1e-5


def build(
    backend: str, checkpoint: Path | dict[str, Any], /, head: str = "lm", **config: Any
) -> Engine:
    """``checkpoint``: a Hugging Face directory, or a model description."""
    settings = {
        "model": checkpoint if isinstance(checkpoint, dict) else str(checkpoint),
        "micro_batch_size": 2,
        "seed": 3,
        "optimizer": {"lr": 1e-2, "clip_grad": 1.0},
        **config,
    }
    return Engine.build(head=head, backend=backend, device="cpu", config=settings).initialize()


def log_probs(engine: Engine, batch: Any) -> torch.Tensor:
    return engine.infer_batch(batch)["log_probs"].values().clone()


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def base_parameters(engine: Engine) -> dict[str, torch.Tensor]:
    return {
        name: local(param.detach()).clone()
        for module in engine.backend.modules()
        for name, param in module.named_parameters()
        if "lora" not in name
    }


def train(
    engine: Engine, batch_seed: int = 2, steps: int = STEPS, loss: Any = sft_loss
) -> list[float]:
    with engine.train_mode():
        return [
            float(
                engine.train_batch(random_batch(LENGTHS, VOCAB, seed=batch_seed + step), loss)[
                    "loss"
                ]
            )
            for step in range(steps)
        ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint("qwen2", tmp_path_factory.mktemp("hf") / "qwen2")


@pytest.fixture(scope="module")
def runs(checkpoint: Path) -> Iterator[dict[str, dict[str, Any]]]:
    """Per backend: a base engine and a LoRA engine before and after training."""
    destroy_mesh()
    batch = random_batch(LENGTHS, VOCAB, seed=1)
    found: dict[str, dict[str, Any]] = {}
    for backend in BACKENDS:
        base = build(backend, checkpoint)
        engine = build(backend, checkpoint, lora=LORA)
        run: dict[str, Any] = {
            "engine": engine,
            "batch": batch,
            "base_log_probs": log_probs(base, batch),
            "base_weights": dict(base.get_per_tensor_param()),
            "initial_log_probs": log_probs(engine, batch),
            "base_before": base_parameters(engine),
        }
        run["losses"] = train(engine)
        run["base_after"] = base_parameters(engine)
        run["log_probs"] = log_probs(engine, batch)
        with engine.disable_adapter():
            run["disabled_log_probs"] = log_probs(engine, batch)
            run["disabled_weights"] = dict(engine.get_per_tensor_param())
        run["merged"] = dict(engine.get_per_tensor_param())
        run["adapters"] = dict(engine.get_per_tensor_param(adapter_only=True))
        found[backend] = run
    yield found
    destroy_mesh()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_adapter_changes_no_output(runs: dict[str, Any], backend: str) -> None:
    run = runs[backend]
    assert torch.equal(run["initial_log_probs"], run["base_log_probs"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_adapters_train_and_the_optimizer_holds_only_them(
    runs: dict[str, Any], backend: str
) -> None:
    engine = runs[backend]["engine"]
    trainable = {
        name: param
        for module in engine.backend.modules()
        for name, param in module.named_parameters()
        if param.requires_grad
    }
    assert len(trainable) == 2 * 2 * len(ADAPTED)  # A and B, 2 layers
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimizer = engine.backend._optimizer
    held = [param for group in optimizer.param_groups for param in group["params"]]
    assert {id(param) for param in held} == {id(param) for param in trainable.values()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_moves_the_adapters_and_leaves_the_base_weights(
    runs: dict[str, Any], backend: str
) -> None:
    run = runs[backend]
    assert run["losses"][1] < run["losses"][0]
    assert float((run["log_probs"] - run["base_log_probs"]).abs().max()) > 1e-3
    assert all(
        float(t.abs().max()) > 1e-4 for name, t in run["adapters"].items() if "lora_B" in name
    )
    before, after = run["base_before"], run["base_after"]
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_adapter_gives_a_fresh_base_engine_bit_for_bit(
    runs: dict[str, Any], backend: str
) -> None:
    run = runs[backend]
    assert torch.equal(run["disabled_log_probs"], run["base_log_probs"])
    assert torch.equal(log_probs(run["engine"], run["batch"]), run["log_probs"])  # on again
    # its weights are the base model's, under the same names as the merged ones
    disabled, base, merged = run["disabled_weights"], run["base_weights"], run["merged"]
    assert disabled.keys() == base.keys() == merged.keys()
    assert all(torch.equal(disabled[name], base[name]) for name in base)
    assert any(not torch.equal(disabled[name], merged[name]) for name in base)


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_inside_disable_adapter_is_refused(runs: dict[str, Any], backend: str) -> None:
    engine, batch = runs[backend]["engine"], runs[backend]["batch"]
    with engine.disable_adapter():
        with pytest.raises(EngineStateError, match=r"train_batch\(\).*disable_adapter"):
            engine.train_batch(batch, sft_loss)
        with pytest.raises(EngineStateError, match="not reentrant"), engine.disable_adapter():
            pass
    assert torch.equal(log_probs(engine, batch), runs[backend]["log_probs"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_merged_export_is_the_base_plus_scaled_b_a_exactly(
    runs: dict[str, Any], backend: str
) -> None:
    run = runs[backend]
    base, merged, adapters = run["base_weights"], run["merged"], run["adapters"]
    assert merged.keys() == base.keys()
    adapted = 0
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        a_name = f"{PEFT_PREFIX}{module}.lora_A.weight"
        if name.endswith(".weight") and a_name in adapters:
            delta = adapter_delta(adapters[a_name], adapters[a_name.replace("_A.", "_B.")], SCALE)
            expected = (weight.float() + delta).to(weight.dtype)
            adapted += 1
        else:
            expected = weight
        assert torch.equal(merged[name], expected), name
    assert adapted == 2 * len(ADAPTED)


def test_both_backends_train_the_same_adapters(runs: dict[str, Any]) -> None:
    megatron, fsdp2 = runs["megatron"], runs["fsdp2"]
    assert megatron["losses"] == pytest.approx(fsdp2["losses"], rel=TOLERANCE)
    diff = float((megatron["log_probs"] - fsdp2["log_probs"]).abs().max())
    assert megatron["adapters"].keys() == fsdp2["adapters"].keys()
    adapter_diff = max(
        float((megatron["adapters"][n] - fsdp2["adapters"][n]).abs().max())
        for n in megatron["adapters"]
    )
    print(f"megatron vs fsdp2 LoRA: log-probs {diff:.1e}, adapters {adapter_diff:.1e}")
    assert diff <= TOLERANCE
    assert adapter_diff <= TOLERANCE


def peft_log_probs(checkpoint: Path, adapter: Path, batch: Any) -> torch.Tensor:
    """transformers' model with peft's adapter loaded: log p(x_t | x_<t), position 0 as 0."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    rows = []
    with torch.no_grad():
        for ids in batch["input_ids"].unbind():
            logits = model(input_ids=ids[None]).logits[0, :-1].float()
            scored = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
            rows.append(torch.cat([scored.new_zeros(1), scored]))
    return torch.cat(rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_peft_adapter_loads_in_peft_with_the_same_log_probs(
    runs: dict[str, Any], checkpoint: Path, tmp_path: Path, backend: str
) -> None:
    run = runs[backend]
    run["engine"].save_hf(tmp_path / "adapter", adapter_only=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == run["adapters"].keys()
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in saved
    got = peft_log_probs(checkpoint, tmp_path / "adapter", run["batch"])
    diff = float((got - run["log_probs"]).abs().max())
    print(f"{backend}: max |peft - engine| log-prob = {diff:.1e}")
    assert diff <= TOLERANCE
    assert float((got - run["base_log_probs"]).abs().max()) > 100 * TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_hf_writes_the_merged_model(
    runs: dict[str, Any], tmp_path: Path, backend: str
) -> None:
    from safetensors.torch import load_file

    run = runs[backend]
    run["engine"].save_hf(tmp_path / "merged")
    saved = load_file(tmp_path / "merged" / "model.safetensors")
    assert all(torch.equal(saved[name], run["merged"][name]) for name in saved)
    assert not any("lora" in name for name in saved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_resumes_the_adapters_and_their_optimizer_bit_exactly(
    fresh_mesh: None, checkpoint: Path, tmp_path: Path, backend: str
) -> None:
    engine = build(backend, checkpoint, lora=LORA)
    train(engine, batch_seed=5, steps=1)
    engine.save_checkpoint(tmp_path)
    continued = train(engine, batch_seed=6, steps=1)
    expected = dict(engine.get_per_tensor_param(adapter_only=True))
    resumed = build(backend, checkpoint, lora=LORA)
    resumed.load_checkpoint(tmp_path)
    assert train(resumed, batch_seed=6, steps=1) == continued
    got = dict(resumed.get_per_tensor_param(adapter_only=True))
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    for other in (None, {**LORA, "rank": 2}):  # no adapters, or others: refused, not dropped
        with pytest.raises(CheckpointError, match="was saved with lora="):
            build(backend, checkpoint, lora=other).load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"rank": 0}, "LoraConfig.rank must be > 0"),
        ({"alpha": 0}, "LoraConfig.alpha must be > 0"),
        ({"dropout": 1.0}, r"LoraConfig.dropout must be in \[0, 1\)"),
        ({"target_modules": ["q", "lm_head"]}, "unknown module 'lm_head'"),
        ({"target_modules": "q_proj"}, "target_modules must be a list"),
        ({"target_modules": []}, "at least one module"),
        ({"ranks": 4}, "unknown LoraConfig field"),
    ],
)
def test_a_bad_lora_config_is_refused_naming_the_field(lora: dict[str, Any], message: str) -> None:
    from engine.config import EngineConfig

    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict({"lora": lora})


def test_short_and_hugging_face_target_names_are_the_same() -> None:
    from engine.config import EngineConfig

    short = EngineConfig(lora={"target_modules": ["v", "q", "down_proj", "q_proj"]})
    assert short.lora is not None
    assert short.lora.target_modules == ("q_proj", "v_proj", "down_proj")
    assert EngineConfig(lora={"rank": 8}).lora.scale == 1.0  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_on_a_mixture_of_experts_model_is_refused_by_name(backend: str) -> None:
    model = tiny_model(num_experts=4, experts_per_token=2)
    with pytest.raises(ConfigError, match="lora on a mixture-of-experts model"):
        Engine.build(head="lm", backend=backend, device="cpu", config={"model": model, "lora": {}})


def test_megatron_lora_refuses_what_its_adapters_cannot_read() -> None:
    from engine.config import EngineConfig
    from strategies.backends.megatron.lora import check_lora

    with pytest.raises(ConfigError, match="layer_spec='local'"):
        check_lora(EngineConfig.from_dict({"lora": {}}), True)
    # sequence parallelism: the adapters read and write the sequence as the linears do
    check_lora(
        EngineConfig.from_dict(
            {"parallel": {"tensor_parallel_size": 2, "sequence_parallel": True}, "lora": {}}
        ),
        False,
    )


def test_disable_adapter_and_adapter_export_need_lora(fresh_mesh: None) -> None:
    engine = Engine.build(head="lm", device="cpu", config={"model": tiny_model()}).initialize()
    refused = pytest.raises(ConfigError, match=r"disable_adapter.*config\.lora is None")
    with refused, engine.disable_adapter():
        pass
    with pytest.raises(ConfigError, match=r"adapter_only=True.*config\.lora is None"):
        engine.get_per_tensor_param(adapter_only=True)


RECOMPUTE = {
    "megatron": {
        "transformer_overrides": {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    },
    "fsdp2": {"activation_checkpointing": True},
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_recomputed_layers_train_the_same_adapters(
    runs: dict[str, Any], checkpoint: Path, backend: str
) -> None:
    """Recomputation (megatron's full recompute, a reentrant checkpoint whose output has a
    gradient only if an input has one; fsdp2's activation checkpointing) with a frozen
    embedding: the same losses and adapters as without."""
    engine = build(backend, checkpoint, lora=LORA, backend=RECOMPUTE[backend])
    losses = train(engine)
    assert losses == pytest.approx(runs[backend]["losses"], abs=1e-6)
    adapters = dict(engine.get_per_tensor_param(adapter_only=True))
    for name, tensor in runs[backend]["adapters"].items():
        torch.testing.assert_close(adapters[name], tensor, atol=1e-6, rtol=0)


#: Megatron-Bridge's ``lora`` type (verl's megatron default): one adapter per megatron linear,
#: the projections of linear_qkv and linear_fc1 sharing its A, drawn Xavier-uniform.
SHARED = {
    "rank": 4,
    "alpha": 8,
    "target_modules": ["q", "k", "v", "gate", "up", "down"],
    "share_a": True,
    "a_init": "xavier",
}


def test_a_shared_a_trains_one_adapter_per_fused_linear_on_both_backends(
    fresh_mesh: None, checkpoint: Path, tmp_path: Path
) -> None:
    """``share_a``: q/k/v hold one ``A``, gate/up another (one parameter each, drawn
    Xavier-uniform from the first projection's name); both backends train the same adapters;
    the PEFT adapter (the shared ``A`` under each projection's name) loads in peft with the
    engine's log-probs; a checkpoint resumes the step exactly."""
    from strategies.model.peft_lora import draw_a

    batch = random_batch(LENGTHS, VOCAB, seed=1)
    found = {}
    for backend in BACKENDS:
        engine = build(backend, checkpoint, lora=SHARED)
        (module,) = engine.backend.modules()
        trainable = [p for p in module.parameters() if p.requires_grad]
        assert len(trainable) == 2 * (3 + 6)  # per layer: A of qkv, gate/up, down; six B
        initial = dict(engine.get_per_tensor_param(adapter_only=True))
        for layer in (0, 1):
            for block, fused in (("self_attn", ("q", "k", "v")), ("mlp", ("gate", "up"))):
                name = f"model.layers.{layer}.{block}.{fused[0]}_proj.lora_A.weight"
                drawn = draw_a(tuple(initial[PEFT_PREFIX + name].shape), 3, name, "xavier")
                for target in fused:
                    copy = PEFT_PREFIX + name.replace(f"{fused[0]}_proj", f"{target}_proj")
                    assert torch.equal(initial[copy], drawn), (backend, copy)
        losses = train(engine)
        engine.save_hf(tmp_path / backend, adapter_only=True)
        found[backend] = {
            "losses": losses,
            "log_probs": log_probs(engine, batch),
            "adapters": dict(engine.get_per_tensor_param(adapter_only=True)),
        }
        got = peft_log_probs(checkpoint, tmp_path / backend, batch)
        assert float((got - found[backend]["log_probs"]).abs().max()) <= TOLERANCE, backend
        engine.save_checkpoint(tmp_path / f"{backend}-checkpoint")
        continued = train(engine, batch_seed=6, steps=1)
        resumed = build(backend, checkpoint, lora=SHARED)
        resumed.load_checkpoint(tmp_path / f"{backend}-checkpoint")
        assert train(resumed, batch_seed=6, steps=1) == continued, backend
    megatron, fsdp2 = found["megatron"], found["fsdp2"]
    assert megatron["losses"] == pytest.approx(fsdp2["losses"], rel=TOLERANCE)
    assert float((megatron["log_probs"] - fsdp2["log_probs"]).abs().max()) <= TOLERANCE
    assert megatron["adapters"].keys() == fsdp2["adapters"].keys()
    for name, tensor in megatron["adapters"].items():
        torch.testing.assert_close(fsdp2["adapters"][name], tensor, atol=TOLERANCE, rtol=0)
