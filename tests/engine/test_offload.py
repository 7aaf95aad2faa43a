"""Offload: model, optimizer state and gradients leave the device and come back unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import Engine
from engine.losses import sft_loss, value_regression_loss
from heads.errors import ConfigError, EngineStateError
from strategies.backends.megatron import state_tensors
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, tiny_model

LOSSES = {"lm": sft_loss, "value": value_regression_loss}
BATCHES = [random_batch([5, 9, 3, 12], 64, seed=step) for step in range(4)]


def _engine(head: str, **config: Any) -> Engine:
    settings = {"model": tiny_model(), "micro_batch_size": 2, "optimizer": {"lr": 1e-3}, **config}
    return Engine.build(head=head, device="cpu", config=settings).initialize()


def device_bytes(engine: Engine) -> dict[str, int]:
    """Bytes the model, optimizer state and gradient buffers hold on the device."""
    backend: Any = engine.backend
    model = state_tensors.model_tensors(backend._chunks, backend._wrapped)
    parts = {
        "model": model,
        "optimizer": state_tensors.optimizer_tensors(backend._optimizer),
        "grad": state_tensors.grad_tensors(backend._wrapped),
    }
    storages = {name: {t.untyped_storage().data_ptr(): t for t in ts} for name, ts in parts.items()}
    for shared in set(storages["model"]):  # non-distributed optimizers step the model's own tensors
        storages["optimizer"].pop(shared, None)
    return {
        name: sum(t.untyped_storage().nbytes() for t in by_storage.values())
        for name, by_storage in storages.items()
    }


@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize("distributed", [False, True])
def test_offloading_everything_frees_the_device_and_training_continues_bit_exactly(
    fresh_mesh: None, head: str, distributed: bool
) -> None:
    backend = {"use_distributed_optimizer": distributed}
    plain = _engine(head, backend=backend)
    expected = [plain.train_batch(batch, LOSSES[head])["loss"] for batch in BATCHES]
    destroy_mesh()

    engine = _engine(head, backend=backend)
    losses = [engine.train_batch(batch, LOSSES[head])["loss"] for batch in BATCHES[:2]]
    before = device_bytes(engine)
    assert all(size > 0 for size in before.values())
    engine.to("cpu")
    assert device_bytes(engine) == {"model": 0, "optimizer": 0, "grad": 0}
    assert engine.backend.offloaded() == {"model", "optimizer", "grad"}
    engine.to("device")
    assert device_bytes(engine) == before
    losses += [engine.train_batch(batch, LOSSES[head])["loss"] for batch in BATCHES[2:]]
    assert losses == expected


def test_offloading_only_the_optimizer_keeps_the_model_usable(fresh_mesh: None) -> None:
    engine = _engine("lm")
    engine.train_batch(BATCHES[0], sft_loss)
    engine.to("cpu", model=False, grad=False)
    assert device_bytes(engine)["optimizer"] == 0
    assert device_bytes(engine)["model"] > 0
    assert engine.infer_batch(BATCHES[1]) is not None
    with pytest.raises(EngineStateError, match="optimizer on the device, but it is offloaded"):
        engine.train_batch(BATCHES[1], sft_loss)
    engine.to("device", model=False, grad=False)
    assert engine.train_batch(BATCHES[1], sft_loss)["loss"] > 0


def test_configured_offload_happens_on_leaving_train_and_eval_mode(fresh_mesh: None) -> None:
    engine = _engine("value", offload={"model": True, "optimizer": True, "grad": True})
    with engine.train_mode():
        assert engine.backend.offloaded() == frozenset()
        engine.train_batch(BATCHES[0], value_regression_loss)
    assert engine.backend.offloaded() == {"model", "optimizer", "grad"}
    with pytest.raises(EngineStateError, match="offloaded"):
        engine.infer_batch(BATCHES[0])
    with engine.eval_mode():
        assert engine.backend.offloaded() == {"optimizer", "grad"}
        assert engine.infer_batch(BATCHES[0])["values"].shape[0] == 4
    assert engine.backend.offloaded() == {"model", "optimizer", "grad"}


def test_to_rejects_an_unknown_destination(fresh_mesh: None) -> None:
    with pytest.raises(ConfigError, match="to\\(\\) takes 'cpu'"):
        _engine("lm").to("gpu")


def test_an_offload_while_exporting_weights_is_refused_until_the_model_is_back(
    fresh_mesh: None,
) -> None:
    engine = _engine("lm")
    expected = {name: tensor.clone() for name, tensor in engine.get_per_tensor_param()}
    weights = engine.get_per_tensor_param()
    got = dict([next(weights)])
    engine.to("cpu", optimizer=False, grad=False)
    with pytest.raises(EngineStateError, match=r"while its iterator is in use.*offloaded"):
        next(weights)
    engine.to("device", optimizer=False, grad=False)
    got.update((name, tensor.clone()) for name, tensor in weights)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
