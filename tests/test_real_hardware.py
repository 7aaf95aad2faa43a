"""Cells on real accelerators; skipped cleanly where the hardware is absent.

Each runs in a fresh process: the CPU cells of the suite turn megatron-core's CPU compatibility
layer on for their whole process, which a real device must not see.
"""

from __future__ import annotations

import pytest

from engine.registry import DEVICES
from tests.multiprocess import run_ranks


def train_and_infer_on(device: str, head: str, backend: str) -> list[float]:
    from engine import Engine
    from tests.factories import raise_outputs_loss, random_batch, tiny_model

    engine = Engine.build(
        head=head,
        backend=backend,
        device=device,
        config={"model": tiny_model(), "optimizer": {"lr": 3e-4}},
    ).initialize()
    batch = random_batch([5, 9, 14], 64)
    with engine.train_mode():
        losses = [engine.train_batch(batch, raise_outputs_loss)["loss"] for _ in range(4)]
    assert engine.device is not None and engine.device.type == device
    assert set(engine.infer_batch(batch).keys()) == set(engine.head.outputs)
    return losses


def _usable(device: str) -> bool:
    return bool(DEVICES.create(device).availability().ok)


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cuda", marks=pytest.mark.cuda),
        pytest.param("npu", marks=pytest.mark.npu),
    ],
)
def test_cell_trains_on_real_hardware(device: str, head: str, backend: str) -> None:
    if not _usable(device):
        pytest.skip(f"no usable {device} here: {DEVICES.create(device).availability().reason}")
    (losses,) = run_ranks(train_and_infer_on, 1, device, head, backend, timeout=300)
    assert losses[-1] < losses[0]
