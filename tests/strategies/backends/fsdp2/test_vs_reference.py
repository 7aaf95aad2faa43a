"""The fsdp2 Engine trains like a hand-written FSDP2 loop (tests/fsdp2_reference.py)."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig
from engine.losses import sft_loss
from tests.factories import random_batch, tiny_model
from tests.fsdp2_reference import ReferenceFsdp2Trainer


@pytest.mark.parametrize("micro_batch_size", [1, 3, 8])
def test_engine_losses_equal_a_hand_written_fsdp2_loop(micro_batch_size: int) -> None:
    config = EngineConfig.from_dict(
        {
            "model": tiny_model(),
            "micro_batch_size": micro_batch_size,
            "seed": 7,
            "optimizer": {"lr": 1e-3, "clip_grad": 1.0, "weight_decay": 0.01},
        }
    )
    batches = [random_batch([5, 17, 9, 30, 2, 12, 21, 8], 64, seed=step % 2) for step in range(6)]
    engine = Engine.build(head="lm", backend="fsdp2", device="cpu", config=config).initialize()
    with engine.train_mode():
        engine_losses = [engine.train_batch(batch, sft_loss)["loss"] for batch in batches]
    reference = ReferenceFsdp2Trainer(config)
    reference_losses = [
        reference.train_step(
            [row.tolist() for row in batch["input_ids"].unbind()],
            [row.tolist() for row in batch["loss_mask"].unbind()],
        )
        for batch in batches
    ]
    assert engine_losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    assert engine_losses[4] < engine_losses[2] < engine_losses[0]  # the same batch, re-seen
