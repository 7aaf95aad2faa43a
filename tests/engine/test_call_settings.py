"""Per-call settings (``settings=`` of ``forward_backward_batch``, ``train_batch``,
``infer_batch``): a call runs exactly as on an engine built with them, calls with different
settings do not leak into each other, the engine's head and config stay the built objects, and
bad settings are refused by name before anything runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from engine import CallSettings, Engine
from engine.losses import entropy_bonus, sft_loss
from heads.errors import ConfigError
from heads.value import ValueHead
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, snapshot, tiny_model, unchanged

BACKENDS = ("megatron", "fsdp2")
CONFIG = {"model": tiny_model(), "micro_batch_size": 4, "optimizer": {"lr": 1e-3}}
BATCH = random_batch([3, 6, 4, 5, 7], 64)
#: What the "other" engines are built with, as one call's settings.
OTHER = CallSettings(micro_batch_size=1, head={"temperature": 0.5, "compute_entropy": True})


def build(backend: str, **config: Any) -> Engine:
    return Engine.build(head="lm", backend=backend, device="cpu", config={**CONFIG, **config})


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[tuple[str, str], Engine]]:
    """Per backend: one engine as built ("built") and one built with ``OTHER`` ("other"), the
    same weights (drawn from the same seed); a test that trains trains both alike."""
    destroy_mesh()
    yield {
        (backend, name): build(backend, **config).initialize()
        for backend in BACKENDS
        for name, config in (
            ("built", {}),
            ("other", {"micro_batch_size": 1, "head": OTHER.head}),
        )
    }
    destroy_mesh()


@pytest.fixture(params=BACKENDS)
def pair(request: pytest.FixtureRequest, engines: dict[tuple[str, str], Engine]) -> list[Engine]:
    """The "built" and "other" engine of each backend."""
    return [engines[request.param, name] for name in ("built", "other")]


def assert_same(first: Any, second: Any) -> None:
    """The same outputs bit for bit (jagged ones by their values)."""
    assert set(first.keys()) == set(second.keys())
    for key in first.keys():
        a, b = first[key], second[key]
        assert torch.equal(a.values() if a.is_nested else a, b.values() if b.is_nested else b), key


def test_interleaved_calls_each_run_as_an_engine_built_with_their_settings(
    pair: list[Engine],
) -> None:
    engine, other = pair
    head, config = engine.head, engine.config
    as_other = engine.infer_batch(BATCH, settings=OTHER)
    as_built = engine.infer_batch(BATCH)
    as_mapping = engine.infer_batch(BATCH, settings={"head": {"temperature": 0.5}})
    again = engine.infer_batch(BATCH, settings=OTHER)
    assert set(as_built.keys()) == {"log_probs"}
    assert set(as_other.keys()) == {"log_probs", "entropy"}
    assert_same(as_other, other.infer_batch(BATCH))
    assert_same(again, as_other)
    assert_same(as_mapping, {"log_probs": as_other["log_probs"]})  # temperature, no entropy
    assert not torch.equal(as_built["log_probs"].values(), as_other["log_probs"].values())

    stepped = engine.forward_backward_batch(BATCH, sft_loss, settings=OTHER)
    plain = engine.forward_backward_batch(BATCH, sft_loss)
    assert len(plain["loss"]) == 2 and len(stepped["loss"]) == 5  # 4 sequences, then 1
    assert stepped["loss"] == other.forward_backward_batch(BATCH, sft_loss)["loss"]
    assert_same(stepped["model_output"], as_other)
    assert engine.head is head and engine.config is config


def test_a_training_step_with_settings_equals_one_on_an_engine_built_with_them(
    pair: list[Engine],
) -> None:
    engine, other = pair
    head, config = engine.head, engine.config
    ours = engine.train_batch(BATCH, sft_loss, settings=OTHER)
    theirs = other.train_batch(BATCH, sft_loss)
    for key in ("loss", "grad_norm", "lr", "sft_loss"):
        assert ours[key] == theirs[key], key
    assert_same(engine.infer_batch(BATCH, settings=OTHER), other.infer_batch(BATCH))
    assert engine.head is head and engine.config is config


def test_a_loss_reading_entropy_runs_when_the_call_turns_entropy_on(pair: list[Engine]) -> None:
    engine = pair[0]
    result = engine.forward_backward_batch(BATCH, entropy_bonus, settings=OTHER)
    assert len(result["loss"]) == 5
    with pytest.raises(ConfigError, match="reads the head output\\(s\\) 'entropy'"):
        engine.forward_backward_batch(BATCH, entropy_bonus)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_calls_micro_batching_plans_as_the_built_configuration_would(backend: str) -> None:
    """A token budget for a call on an engine built with a micro-batch size, and the other
    way round (planning needs no initialised engine)."""
    fixed, budget = build(backend), build(backend, max_tokens_per_micro_batch=16)
    as_budget = fixed.plan_micro_batches(BATCH, settings={"max_tokens_per_micro_batch": 16})
    assert as_budget == budget.plan_micro_batches(BATCH)
    assert budget.plan_micro_batches(BATCH, settings={"micro_batch_size": 4}) == (
        fixed.plan_micro_batches(BATCH)
    )


BAD_SETTINGS = {
    "micro_batch_size 0": (
        {"micro_batch_size": 0},
        "CallSettings.micro_batch_size must be > 0",
    ),
    "size and budget": (
        {"micro_batch_size": 2, "max_tokens_per_micro_batch": 64},
        "micro_batch_size or max_tokens_per_micro_batch, not both",
    ),
    "unknown setting": ({"micro_batch": 2}, "CallSettings has no field\\(s\\) micro_batch"),
    "unknown head option": (
        {"head": {"tempreature": 0.5}},
        "head 'lm' has no option\\(s\\) tempreature \\(did you mean 'temperature'\\?\\)",
    ),
    "bad head value": ({"head": {"temperature": 0.0}}, "LMHead.temperature must be > 0"),
    "output layer": ({"head": {"fused": False}}, "change the model's output layer"),
    "not settings": ("fast", "settings must be CallSettings, a mapping or None"),
}
CALLS: dict[str, Callable[[Engine, Any], Any]] = {
    "infer_batch": lambda engine, settings: engine.infer_batch(BATCH, settings=settings),
    "forward_backward_batch": lambda engine, settings: engine.forward_backward_batch(
        BATCH, sft_loss, settings=settings
    ),
    "train_batch": lambda engine, settings: engine.train_batch(BATCH, sft_loss, settings=settings),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_bad_settings_are_refused_by_name_and_change_nothing(
    engines: dict[tuple[str, str], Engine], case: str, call: str
) -> None:
    engine = engines["megatron", "built"]
    settings, message = BAD_SETTINGS[case]
    head, config, before = engine.head, engine.config, snapshot(engine)
    with pytest.raises(ConfigError, match=message):
        CALLS[call](engine, settings)
    assert engine.head is head and engine.config is config and unchanged(before, engine)


def test_settings_are_checked_when_made_and_against_the_head() -> None:
    with pytest.raises(ConfigError, match=r"CallSettings\.max_tokens_per_micro_batch must be > 0"):
        CallSettings(max_tokens_per_micro_batch=-1)
    with pytest.raises(ConfigError, match="head 'value' has no option\\(s\\) temperature"):
        CallSettings(head={"temperature": 1.0}).head_of(ValueHead())
