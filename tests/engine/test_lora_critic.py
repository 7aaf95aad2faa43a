"""LoRA with a value head (a PPO critic) on both backends, one process.

The head's own output layer is new, so with LoRA it trains whole beside the adapters (peft's
``modules_to_save``); every other base weight stays frozen. Same tiny random Qwen2 checkpoint
and adapters as ``test_lora.py`` (rank 4, alpha 8 on q, v, o, up, down), two AdamW steps of
``value_regression_loss`` at lr 1e-2. Measured here: megatron and fsdp2 agree within 3e-7 on
values, adapters and the head layer after the steps (checked against 1e-5); the PEFT adapter
loaded by peft onto transformers' ``AutoModelForTokenClassification`` (``num_labels=1``) gives
the engine's values within 2e-7 (checked against 1e-5). Exact (``torch.equal``): a new adapter
changes no value, the base weights do not move, ``disable_adapter()`` gives the base body under
the trained head layer, and a checkpoint resumes to the same adapters, head and optimizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine
from engine.losses import value_regression_loss
from strategies.backends.megatron.mesh import destroy_mesh
from strategies.model.peft_lora import PEFT_PREFIX
from tests.engine.test_lora import BACKENDS, LENGTHS, LORA, local
from tests.engine.test_lora import build as lora_build
from tests.engine.test_lora import train as lora_train
from tests.factories import random_batch, tiny_model
from tests.strategies.backends.megatron.test_hf import VOCAB, save_checkpoint

ADAPTED = 5  # q, v, o, up, down
STEPS = 2
TOLERANCE = 1e-5
HEAD = "score.weight"
SCORE = f"{PEFT_PREFIX}score.weight"


def build(backend: str, checkpoint: Path | dict[str, Any], **config: Any) -> Engine:
    """``test_lora``'s engine, with a value head unless ``head`` says otherwise."""
    return lora_build(backend, checkpoint, **{"head": "value", **config})


def values(engine: Engine, batch: Any) -> torch.Tensor:
    return engine.infer_batch(batch)["values"].values().clone()


def named_parameters(engine: Engine) -> Iterator[tuple[str, torch.nn.Parameter]]:
    for module in engine.backend.modules():
        yield from module.named_parameters()


def is_head_layer(name: str) -> bool:
    """The head's output layer: megatron's ``output_layer``, fsdp2's ``value_head``."""
    return name.split(".")[-2] in ("output_layer", "value_head")


def frozen_parameters(engine: Engine) -> dict[str, torch.Tensor]:
    return {
        name: local(param.detach()).clone()
        for name, param in named_parameters(engine)
        if "lora" not in name and not is_head_layer(name)
    }


def train(engine: Engine, batch_seed: int = 2, steps: int = STEPS) -> list[float]:
    return lora_train(engine, batch_seed, steps, loss=value_regression_loss)


def trainable_and_held(engine: Engine) -> tuple[set[str], set[str]]:
    """The names of the parameters that require gradients and of those the optimizer holds
    (read before any forward: FSDP2 leaves its root's parameters unsharded after one)."""
    names = {id(param): name for name, param in named_parameters(engine)}
    trainable = {name for name, param in named_parameters(engine) if param.requires_grad}
    optimizer = engine.backend._optimizer
    held = {names[id(param)] for group in optimizer.param_groups for param in group["params"]}
    return trainable, held


def set_head_layer(engine: Engine, weight: torch.Tensor) -> None:
    """Copy ``weight`` (full) into the engine's head layer (replicated: every shard is it)."""
    with torch.no_grad():
        for name, param in named_parameters(engine):
            if is_head_layer(name):
                local(param).copy_(weight)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint("qwen2", tmp_path_factory.mktemp("hf") / "qwen2")


@pytest.fixture(scope="module")
def runs(checkpoint: Path) -> Iterator[dict[str, dict[str, Any]]]:
    """Per backend: a base critic and a LoRA critic before and after training."""
    destroy_mesh()
    batch = random_batch(LENGTHS, VOCAB, seed=1)
    found: dict[str, dict[str, Any]] = {}
    for backend in BACKENDS:
        base = build(backend, checkpoint)
        engine = build(backend, checkpoint, lora=LORA)
        run: dict[str, Any] = {
            "engine": engine,
            "trainable": trainable_and_held(engine),
            "base": base,
            "batch": batch,
            "base_values": values(base, batch),
            "initial_values": values(engine, batch),
            "initial_head": dict(engine.get_per_tensor_param())[HEAD],
            "frozen_before": frozen_parameters(engine),
        }
        run["losses"] = train(engine)
        run["frozen_after"] = frozen_parameters(engine)
        run["values"] = values(engine, batch)
        with engine.disable_adapter():
            run["disabled_values"] = values(engine, batch)
        run["merged"] = dict(engine.get_per_tensor_param())
        run["adapters"] = dict(engine.get_per_tensor_param(adapter_only=True))
        found[backend] = run
    yield found
    destroy_mesh()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_lora_critic_gives_the_base_critics_values(
    runs: dict[str, Any], backend: str
) -> None:
    run = runs[backend]
    assert torch.equal(run["initial_values"], run["base_values"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_adapters_and_the_head_layer_train_and_the_optimizer_holds_them(
    runs: dict[str, Any], backend: str
) -> None:
    trainable, held = runs[backend]["trainable"]
    heads = [name for name in trainable if "lora" not in name]
    assert len(heads) == 1 and is_head_layer(heads[0])
    assert len(trainable) == 2 * 2 * ADAPTED + 1  # A and B, 2 layers; the head layer
    assert held == trainable


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_moves_the_adapters_and_the_head_and_leaves_the_base_weights(
    runs: dict[str, Any], backend: str
) -> None:
    run = runs[backend]
    assert run["losses"][1] < run["losses"][0]
    assert float((run["values"] - run["base_values"]).abs().max()) > 1e-3
    assert all(
        float(t.abs().max()) > 1e-4 for name, t in run["adapters"].items() if "lora_B" in name
    )
    assert float((run["merged"][HEAD] - run["initial_head"]).abs().max()) > 1e-4
    before, after = run["frozen_before"], run["frozen_after"]
    assert before.keys() == after.keys() and len(before) > 10
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_adapter_gives_the_base_body_under_the_trained_head_layer(
    runs: dict[str, Any], backend: str
) -> None:
    run = runs[backend]
    base = run["base"]
    set_head_layer(base, run["merged"][HEAD])
    try:
        assert torch.equal(run["disabled_values"], values(base, run["batch"]))
    finally:
        set_head_layer(base, run["initial_head"])
    assert not torch.equal(run["disabled_values"], run["base_values"])  # the head trained
    assert torch.equal(values(run["engine"], run["batch"]), run["values"])  # on again


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_adapter_export_holds_the_head_layer_as_peft_saves_it(
    runs: dict[str, Any], backend: str
) -> None:
    run = runs[backend]
    adapters, merged = run["adapters"], run["merged"]
    assert {name for name in adapters if "lora" not in name} == {
        SCORE,
        f"{PEFT_PREFIX}score.bias",
    }
    assert len(adapters) == 2 * 2 * ADAPTED + 2
    assert torch.equal(adapters[SCORE], merged[HEAD])
    assert torch.equal(adapters[f"{PEFT_PREFIX}score.bias"], torch.zeros(1))
    assert HEAD in merged and not any("lora" in name for name in merged)


def test_both_backends_train_the_same_critic(runs: dict[str, Any]) -> None:
    megatron, fsdp2 = runs["megatron"], runs["fsdp2"]
    assert megatron["losses"] == pytest.approx(fsdp2["losses"], rel=TOLERANCE)
    diff = float((megatron["values"] - fsdp2["values"]).abs().max())
    assert megatron["adapters"].keys() == fsdp2["adapters"].keys()
    adapter_diff = max(
        float((megatron["adapters"][n] - fsdp2["adapters"][n]).abs().max())
        for n in megatron["adapters"]
    )
    print(f"megatron vs fsdp2 LoRA critic: values {diff:.1e}, adapters + head {adapter_diff:.1e}")
    assert diff <= TOLERANCE
    assert adapter_diff <= TOLERANCE


def peft_values(checkpoint: Path, adapter: Path, batch: Any) -> torch.Tensor:
    """transformers' token-classification model with peft's adapter: the value of token t
    read at t - 1, position 0 as 0 (the engine's layout)."""
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(
        checkpoint,
        num_labels=1,
        dtype=torch.float32,
        attn_implementation="eager",
        local_files_only=True,
    )
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    rows = []
    with torch.no_grad():
        for ids in batch["input_ids"].unbind():
            scored = model(input_ids=ids[None]).logits[0, :-1, 0].float()
            rows.append(torch.cat([scored.new_zeros(1), scored]))
    return torch.cat(rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_peft_adapter_loads_in_peft_with_the_same_values(
    runs: dict[str, Any], checkpoint: Path, tmp_path: Path, backend: str
) -> None:
    run = runs[backend]
    run["engine"].save_hf(tmp_path / "adapter", adapter_only=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["task_type"], config["modules_to_save"]) == ("TOKEN_CLS", ["score"])
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == run["adapters"].keys()
    got = peft_values(checkpoint, tmp_path / "adapter", run["batch"])
    diff = float((got - run["values"]).abs().max())
    print(f"{backend}: max |peft - engine| value = {diff:.1e}")
    assert diff <= TOLERANCE
    assert float((got - run["base_values"]).abs().max()) > 100 * TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lora_critic_checkpoint_resumes_bit_exactly(
    fresh_mesh: None, checkpoint: Path, tmp_path: Path, backend: str
) -> None:
    engine = build(backend, checkpoint, lora=LORA)
    train(engine, batch_seed=5, steps=1)
    engine.save_checkpoint(tmp_path)
    continued = train(engine, batch_seed=6, steps=2)
    expected = dict(engine.get_per_tensor_param(adapter_only=True))
    resumed = build(backend, checkpoint, lora=LORA)
    resumed.load_checkpoint(tmp_path)
    # without the head layer's optimizer state (Adam moments) the second step would differ
    assert train(resumed, batch_seed=6, steps=2) == continued
    got = dict(resumed.get_per_tensor_param(adapter_only=True))
    assert got.keys() == expected.keys() and SCORE in got
    assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lora_reward_model_trains_its_head_layer_too(fresh_mesh: None, backend: str) -> None:
    engine = build(backend, tiny_model(), head="reward", lora=LORA)
    trainable = [name for name, param in named_parameters(engine) if param.requires_grad]
    assert [name for name in trainable if "lora" not in name] == [
        name for name in trainable if is_head_layer(name)
    ]
    assert len(trainable) == 2 * 2 * ADAPTED + 1
