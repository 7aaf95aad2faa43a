"""The non-finite guard: a NaN or infinite loss, gradient norm or learning rate never reaches the
weights; the step is skipped (weights, optimizer state and LR schedule unchanged) or raises, by
policy, and an empty step (nothing scored) is skipped rather than decaying the weights."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from engine import Engine
from engine.data.batching import jagged
from engine.losses import ActorLoss, value_regression_loss
from engine.non_finite import ZERO_GRADIENT
from heads.errors import NonFiniteError
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, snapshot, tiny_model, unchanged

LENGTHS = [4, 7, 3]


def config(**extra: Any) -> dict[str, Any]:
    """Linear LR decay, so that an LR-schedule step shows in ``current_lr``."""
    return {
        "model": tiny_model(),
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3},
        "scheduler": {"decay_style": "linear"},
        "total_steps": 100,
        **extra,
    }


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    """One mesh: a value engine and an LM engine that skip (two in a row at most), and a value
    engine that raises at once."""
    destroy_mesh()
    built = {
        "value": Engine.build(
            head="value", device="cpu", config=config(non_finite={"max_consecutive_skips": 2})
        ),
        "lm": Engine.build(head="lm", device="cpu", config=config()),
        "raise": Engine.build(
            head="value", device="cpu", config=config(non_finite={"policy": "raise"})
        ),
    }
    yield {name: engine.initialize() for name, engine in built.items()}
    destroy_mesh()


def actor_batch(seed: int = 0) -> TensorDict:
    batch = random_batch(LENGTHS, 64, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    batch["old_log_probs"] = jagged([-torch.rand(n, generator=generator) for n in LENGTHS])
    batch["advantages"] = jagged([torch.randn(n, generator=generator) for n in LENGTHS])
    return batch


LOSSES = {"value": value_regression_loss, "lm": ActorLoss(), "raise": value_regression_loss}


def good_batch(name: str, seed: int = 0) -> TensorDict:
    return actor_batch(seed) if name == "lm" else random_batch(LENGTHS, 64, seed=seed)


def poisoned(name: str, field: str, row: int, token: int, value: float) -> TensorDict:
    batch = good_batch(name)
    rows = [r.clone() for r in batch[field].unbind()]
    rows[row][token] = value
    batch[field] = jagged(rows)
    return batch


def train_good(engine: Engine, name: str) -> None:
    """A good step: applied, so the weights move and the run of skips ends."""
    before = snapshot(engine)
    result = engine.train_batch(good_batch(name, seed=1), LOSSES[name])
    assert result["skipped"] == 0.0 and "skip_reason" not in result
    assert math.isfinite(float(result["loss"])) and not unchanged(before, engine)


#: (engine, field, value): NaN anywhere, infinities where the loss does not bound them (the PPO
#: log-ratio is clamped, so an infinite old log-prob gives a finite, clipped loss by design).
POISONS = [
    *[("value", "returns", value) for value in (math.nan, math.inf, -math.inf)],
    *[("lm", "advantages", value) for value in (math.nan, math.inf, -math.inf)],
    ("lm", "old_log_probs", math.nan),
]


@settings(max_examples=12, deadline=None)
@given(case=st.sampled_from(POISONS), data=st.data())
def test_a_non_finite_value_at_any_scored_token_leaves_weights_optimizer_and_lr_bit_identical(
    engines: dict[str, Engine], case: tuple[str, str, float], data: st.DataObject
) -> None:
    name, field, value = case
    engine = engines[name]
    row = data.draw(st.integers(0, len(LENGTHS) - 1))
    token = data.draw(st.integers(1, LENGTHS[row] - 1))  # loss_mask scores every token but 0
    skipped_so_far = engine.train_batch(good_batch(name), LOSSES[name])["skipped_steps"]
    before, steps = snapshot(engine), engine.global_step

    result = engine.train_batch(poisoned(name, field, row, token, value), LOSSES[name])

    assert unchanged(before, engine) and engine.global_step == steps
    assert result["skipped"] == 1.0 and result["skipped_steps"] == skipped_so_far + 1
    assert str(result["skip_reason"]).startswith("loss is ")
    assert f"field {field!r} row {row}, token {token} holds" in str(result["skip_reason"])
    train_good(engine, name)


def test_a_non_finite_value_at_a_token_the_loss_does_not_score_does_not_skip_the_step(
    engines: dict[str, Engine],
) -> None:
    result = engines["value"].train_batch(
        poisoned("value", "returns", 1, 0, math.nan), value_regression_loss
    )
    assert result["skipped"] == 0.0 and math.isfinite(float(result["loss"]))


def test_a_non_finite_learning_rate_skips_the_step(engines: dict[str, Engine]) -> None:
    engine = engines["value"]
    optimizer: Any = engine.backend._optimizer  # type: ignore[attr-defined]
    learning_rate = engine.backend.current_lr()
    try:
        for group in optimizer.param_groups:
            group["lr"] = math.nan
        before = snapshot(engine)
        result = engine.train_batch(good_batch("value"), value_regression_loss)
        assert result["skipped"] == 1.0 and result["skip_reason"] == "lr is nan"
        assert unchanged(before, engine)
    finally:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
    train_good(engine, "value")


def test_a_batch_that_scores_nothing_is_skipped_not_stepped_with_weight_decay(
    engines: dict[str, Engine],
) -> None:
    engine = engines["raise"]  # a zero gradient is not non-finite: even this policy skips
    batch = good_batch("raise")
    batch["loss_mask"] = jagged([torch.zeros(n) for n in LENGTHS])
    before = snapshot(engine)
    result = engine.train_batch(batch, value_regression_loss)
    assert result["skipped"] == 1.0 and result["skip_reason"] == ZERO_GRADIENT
    assert result["loss"] == 0.0 and unchanged(before, engine)
    train_good(engine, "raise")


def test_the_raise_policy_raises_naming_the_quantity_and_leaves_the_engine_usable(
    engines: dict[str, Engine],
) -> None:
    engine = engines["raise"]
    before = snapshot(engine)
    with pytest.raises(NonFiniteError, match=r"loss is nan.*'returns' row 2, token 1 holds nan"):
        engine.train_batch(poisoned("raise", "returns", 2, 1, math.nan), value_regression_loss)
    assert unchanged(before, engine)
    train_good(engine, "raise")


def test_the_skip_policy_raises_after_more_than_max_consecutive_skips(
    engines: dict[str, Engine],
) -> None:
    engine = engines["value"]  # max_consecutive_skips=2
    for _ in range(2):
        before = snapshot(engine)
        result = engine.train_batch(poisoned("value", "returns", 0, 2, math.inf), LOSSES["value"])
        assert result["skipped"] == 1.0 and unchanged(before, engine)
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row .* the first: loss is"):
        engine.train_batch(poisoned("value", "returns", 0, 2, math.inf), LOSSES["value"])
    assert unchanged(before, engine)
    train_good(engine, "value")  # an applied step ends the run: two skips are allowed again
    for _ in range(2):
        result = engine.train_batch(poisoned("value", "returns", 0, 2, math.nan), LOSSES["value"])
        assert result["skipped"] == 1.0
    train_good(engine, "value")


@pytest.mark.timeout(120)
def test_a_checkpoint_keeps_the_skip_counters(engines: dict[str, Engine], tmp_path: Path) -> None:
    engine = engines["value"]  # max_consecutive_skips=2
    train_good(engine, "value")
    bad = poisoned("value", "returns", 0, 2, math.nan)
    skipped = engine.train_batch(bad, LOSSES["value"])["skipped_steps"]
    engine.save_checkpoint(tmp_path)  # one skip in a row, `skipped` in all
    train_good(engine, "value")
    assert engine.train_batch(bad, LOSSES["value"])["skipped_steps"] == skipped + 1

    engine.load_checkpoint(tmp_path)
    assert engine.train_batch(bad, LOSSES["value"])["skipped_steps"] == skipped + 1
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row"):
        engine.train_batch(bad, LOSSES["value"])
    train_good(engine, "value")


def test_optimizer_step_on_its_own_skips_non_finite_gradients(engines: dict[str, Engine]) -> None:
    engine = engines["value"]
    engine.optimizer_zero_grad()
    engine.forward_backward_batch(
        poisoned("value", "returns", 1, 3, math.nan), value_regression_loss
    )
    before = snapshot(engine)
    assert math.isnan(engine.optimizer_step())
    assert unchanged(before, engine)
    train_good(engine, "value")


def nan_loss_on_rank(rank: int) -> Any:
    """The value loss, plus a NaN (no gradient) on process ``rank`` only: the gradients stay
    finite, so only the agreement over ranks can make the other rank skip too."""
    import os

    def loss(outputs: Any, batch: Any, ctx: Any) -> Any:
        value, metrics = value_regression_loss(outputs, batch, ctx)
        return (value + math.nan if int(os.environ["RANK"]) == rank else value), metrics

    return loss


def guard_on_two_ranks() -> dict[str, dict[str, Any]]:
    """On each rank, at DP=2 and then TP=2: what a non-finite loss on one rank (its output
    rank under TP), a NaN batch field and each policy do."""
    import os

    rank = int(os.environ["RANK"])
    report: dict[str, dict[str, Any]] = {}
    for layout, parallel, nan_rank in (("dp2", {}, 1), ("tp2", {"tensor_parallel_size": 2}, 0)):
        destroy_mesh()
        skipping = Engine.build(
            head="value",
            device="cpu",
            config=config(parallel=parallel, non_finite={"max_consecutive_skips": 1}),
        ).initialize()
        raising = Engine.build(
            head="value",
            device="cpu",
            config=config(parallel=parallel, non_finite={"policy": "raise"}),
        ).initialize()
        seed = rank if layout == "dp2" else 0  # DP ranks take their own shards, TP ranks one
        seen: dict[str, Any] = {}
        params = snapshot(skipping)
        first = skipping.train_batch(good_batch("value", seed), nan_loss_on_rank(nan_rank))
        seen["loss on one rank"] = (first["skipped"], first.get("skip_reason"))
        seen["loss on one rank: unchanged"] = unchanged(params, skipping)
        # A NaN field on rank 0 only (DP; TP ranks share one batch): NaN gradients everywhere.
        poison = rank == 0 or layout == "tp2"
        batch = poisoned("value", "returns", 1, 2, math.nan) if poison else good_batch("value", 1)
        with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
            skipping.train_batch(batch, value_regression_loss)
        seen["field on rank 0, second skip: raised, unchanged"] = unchanged(params, skipping)
        good = skipping.train_batch(good_batch("value", seed), value_regression_loss)
        seen["good step"] = (good["skipped"], unchanged(params, skipping))
        seen["params"] = [
            p.detach().clone() for m in skipping.backend.modules() for p in m.parameters()
        ]
        params = snapshot(raising)
        with pytest.raises(NonFiniteError, match=r"loss is nan \(NonFiniteConfig.policy='raise'\)"):
            raising.train_batch(good_batch("value", seed), nan_loss_on_rank(nan_rank))
        seen["raise: unchanged"] = unchanged(params, raising)
        seen["raise: then a good step"] = raising.train_batch(
            good_batch("value", seed), value_regression_loss
        )["skipped"]
        report[layout] = seen
    return report


@pytest.mark.multiprocess
def test_every_rank_takes_the_same_decision_at_data_and_tensor_parallel_2() -> None:
    from tests.multiprocess import run_ranks

    reports = run_ranks(guard_on_two_ranks, 2, timeout=300)
    for layout in ("dp2", "tp2"):
        for report in reports:
            seen = report[layout]
            assert seen["loss on one rank"] == (1.0, "loss is nan")
            assert seen["loss on one rank: unchanged"]
            assert seen["field on rank 0, second skip: raised, unchanged"]
            assert seen["good step"] == (0.0, False)
            assert seen["raise: unchanged"] and seen["raise: then a good step"] == 0.0
    first, second = (report["dp2"]["params"] for report in reports)
    assert all(map(torch.equal, first, second))  # data-parallel replicas still agree
