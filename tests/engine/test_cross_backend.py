"""The same Hugging Face checkpoint gives the same numbers on the megatron and fsdp2 backends.

Tiny random models (transformers config objects, ``save_pretrained`` into a temporary folder),
float32. Measured here (batch of 4 sequences of 5-12 tokens; Llama, Qwen2 with tied embeddings
and qkv biases, Qwen3 with qk norms): per-token log-probs and entropy agree within 4.8e-7,
values within 9e-8 and reward scores within 8e-8 (checked against 1e-5); after one AdamW step
(lr 1e-2) on the same batch, log-probs agree within 1.4e-6 (``sft_loss``) and values within
5.9e-6 (``value_regression_loss``), checked against 1e-4. The value and reward heads' new layer
is drawn from the same (seed, name) on both backends. Negative controls: another seed draws
another value layer (values differ by 0.44) and one weight scaled by 1.01 moves the log-probs
by 5.3e-3, so the comparison does fail when the models differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine
from engine.losses import sft_loss, value_regression_loss
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch
from tests.strategies.backends.megatron.test_hf import VOCAB, save_checkpoint

BACKENDS = ("megatron", "fsdp2")
FAMILIES = ("llama", "qwen2", "qwen3")
HEADS = {"lm": {"compute_entropy": True}, "value": {}, "reward": {}}
LENGTHS = [7, 12, 5, 9]
INFERENCE_TOLERANCE = 1e-5
AFTER_STEP_TOLERANCE = 1e-4


def build(backend: str, checkpoint: Path, head: str, **config: Any) -> Engine:
    settings = {
        "model": str(checkpoint),
        "micro_batch_size": 2,
        "seed": 3,
        "optimizer": {"lr": 1e-2, "clip_grad": 1.0},
        "head": HEADS[head],
        **config,
    }
    return Engine.build(head=head, backend=backend, device="cpu", config=settings).initialize()


def outputs(engine: Engine, batch: Any) -> dict[str, torch.Tensor]:
    """Every output of the head as one flat tensor (per-token ones without padding)."""
    result = engine.infer_batch(batch)
    return {key: (v.values() if v.is_nested else v).clone() for key, v in result.items()}


def max_diff(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys()
    return max(float((first[key] - second[key]).abs().max()) for key in first)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: save_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def inferred(checkpoints: dict[str, Path]) -> Iterator[dict[tuple[str, str, str], Any]]:
    """Outputs of every (family, head, backend) engine on one batch, forward-only engines."""
    destroy_mesh()
    batch = random_batch(LENGTHS, VOCAB, seed=1)
    found = {
        (family, head, backend): outputs(
            build(backend, checkpoints[family], head, forward_only=True), batch
        )
        for family in FAMILIES
        for head in HEADS
        for backend in BACKENDS
    }
    yield found
    destroy_mesh()


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("family", FAMILIES)
def test_both_backends_give_the_same_outputs_for_the_same_checkpoint(
    inferred: dict[tuple[str, str, str], Any], family: str, head: str
) -> None:
    megatron, fsdp2 = (inferred[(family, head, backend)] for backend in BACKENDS)
    diff = max_diff(megatron, fsdp2)
    print(f"{family} {head}: max |megatron - fsdp2| = {diff:.1e}")
    assert diff <= INFERENCE_TOLERANCE


@pytest.mark.parametrize(("head", "loss"), [("lm", sft_loss), ("value", value_regression_loss)])
def test_after_one_step_on_the_same_batch_both_backends_still_agree(
    fresh_mesh: None, checkpoints: dict[str, Path], head: str, loss: Any
) -> None:
    batch = random_batch(LENGTHS, VOCAB, seed=2)
    trained = {}
    for backend in BACKENDS:
        engine = build(backend, checkpoints["llama"], head)
        before = outputs(engine, batch)
        with engine.train_mode():
            engine.train_batch(batch, loss)
        trained[backend] = outputs(engine, batch)
        assert max_diff(trained[backend], before) > 1e-3  # the step changed the model
    diff = max_diff(trained["megatron"], trained["fsdp2"])
    print(f"llama {head} after one step: max |megatron - fsdp2| = {diff:.1e}")
    assert diff <= AFTER_STEP_TOLERANCE


def test_the_comparison_fails_for_another_value_layer_or_a_perturbed_weight(
    inferred: dict[tuple[str, str, str], Any], checkpoints: dict[str, Path]
) -> None:
    batch = random_batch(LENGTHS, VOCAB, seed=1)
    reseeded = outputs(build("fsdp2", checkpoints["llama"], "value", seed=4), batch)
    reseeded_diff = max_diff(reseeded, inferred[("llama", "value", "megatron")])
    engine = build("fsdp2", checkpoints["llama"], "lm")
    model = engine.backend.modules()[0]
    with torch.no_grad():
        model.get_parameter("model.layers.0.self_attn.o_proj.weight").mul_(1.01)
    perturbed_diff = max_diff(outputs(engine, batch), inferred[("llama", "lm", "megatron")])
    print(f"another seed: {reseeded_diff:.1e}; one weight x 1.01: {perturbed_diff:.1e}")
    assert reseeded_diff > 1e-2
    assert perturbed_diff > 100 * INFERENCE_TOLERANCE
