"""Bad input gets a specific error, and the engine stays usable afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine import Engine
from engine.data.batching import from_token_lists, to_padded
from engine.losses import sft_loss, value_regression_loss
from heads.errors import (
    BatchError,
    ConfigError,
    EngineStateError,
    UnknownStrategyError,
)
from heads.lm import LMHead
from tests.factories import random_batch, tiny_model

CONFIG = {"model": tiny_model(), "micro_batch_size": 2, "optimizer": {"lr": 1e-3}}


@pytest.fixture
def critic(fresh_mesh: None) -> Engine:
    return Engine.build(head="value", device="cpu", config=CONFIG).initialize()


def parameters(engine: Engine) -> list[torch.Tensor]:
    return [p.detach().clone() for module in engine.backend.modules() for p in module.parameters()]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"head": "valeu"}, r"unknown head 'valeu'; did you mean 'value'\?"),
        ({"backend": "megatorn"}, r"unknown backend 'megatorn'; did you mean 'megatron'\?"),
        (
            {"device": "gpu"},
            r"unknown device 'gpu'; did you mean 'cuda'\?.*Known devices: cpu, cuda",
        ),
        ({"device": "CPU"}, r"unknown device 'CPU'; did you mean 'cpu'\?"),
        ({"head": "Value"}, r"unknown head 'Value'; did you mean 'value'\?"),
    ],
)
def test_unknown_or_misspelled_names_are_answered_with_the_known_names(
    kwargs: dict[str, str], expected: str
) -> None:
    with pytest.raises(UnknownStrategyError, match=expected):
        Engine.build(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"head": 42}, r"head must be a name .* or a Head object; got int"),
        ({"head": LMHead}, r"head must be an instance, not the class LMHead"),
        ({"device": object()}, r"platform must be a name .* DevicePlatform object"),
    ],
)
def test_wrong_object_types_are_rejected_naming_the_role(
    kwargs: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        Engine.build(**kwargs)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"optimizer": {"lr": -1.0}}, "lr"),
        ({"optimizer": {"lrr": 1.0}}, "lrr"),
        ({"scheduler": {"decay_style": "cosin"}}, "decay_style"),
        ({"model": {"hidden_size": 30, "num_attention_heads": 4}}, "hidden_size"),
        ({"model": "huge"}, "known presets"),
        ({"dtype": "fp8"}, "dtype"),
        ({"head": {"temperature": "hot"}}, "temperature"),
    ],
)
def test_invalid_config_values_fail_at_build_naming_the_field(
    config: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        Engine.build(head="lm", device="cpu", config=config)


def test_calls_before_initialize_are_refused() -> None:
    engine = Engine.build(head="lm", device="cpu", config=CONFIG)
    for call in (
        lambda: engine.train_batch(random_batch([3], 64), sft_loss),
        lambda: engine.infer_batch(random_batch([3], 64)),
        engine.optimizer_step,
        engine.get_data_parallel_rank,
    ):
        with pytest.raises(EngineStateError, match="call initialize"):
            call()


def test_a_forward_only_engine_refuses_to_train_but_infers(fresh_mesh: None) -> None:
    reference = Engine.build(
        head="lm", device="cpu", config={**CONFIG, "forward_only": True}
    ).initialize()
    batch = random_batch([3, 4], 64)
    with pytest.raises(EngineStateError, match="forward-only"):
        reference.train_batch(batch, sft_loss)
    with pytest.raises(EngineStateError, match="forward-only"):
        reference.optimizer_step()
    assert reference.infer_batch(batch)["log_probs"].shape[0] == 2


def bad_batches() -> list[tuple[Any, str]]:
    good = random_batch([3, 5], 64)
    padded = to_padded(good)
    return [
        ({"input_ids": [[1, 2]]}, "must be a tensordict.TensorDict"),
        (TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]), "has no 'input_ids'"),
        (
            TensorDict({"input_ids": torch.zeros(2, 3), "returns": torch.zeros(2, 3)}, [2]),
            "must be int64 or int32",
        ),
        (
            TensorDict({"input_ids": torch.zeros(2, 3, 1, dtype=torch.long)}, batch_size=[2]),
            r"must be \[B, L\]",
        ),
        (from_token_lists([[1, 2, 3]]), "lacks field.*returns"),
        (from_token_lists([[1, 99]], returns=[[0.0, 0.0]]), r"must lie in \[0, 64\)"),
        (from_token_lists([[1] * 65], returns=[[0.0] * 65]), "more than ModelConfig.max_seq"),
        (
            TensorDict(
                {
                    "input_ids": padded["input_ids"],
                    "attention_mask": padded["attention_mask"][:, :2],
                    "returns": padded["returns"],
                },
                batch_size=[2],
            ),
            "'attention_mask' shape",
        ),
    ]


@pytest.mark.parametrize(("batch", "expected"), bad_batches())
def test_bad_batches_get_a_batch_error_and_leave_the_engine_usable(
    critic: Engine, batch: Any, expected: str
) -> None:
    before = parameters(critic)
    with pytest.raises(BatchError, match=expected):
        critic.train_batch(batch, value_regression_loss)
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(critic), strict=True))
    metrics = critic.train_batch(random_batch([3, 5], 64), value_regression_loss)
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_a_loss_function_that_raises_leaves_the_engine_usable(critic: Engine) -> None:
    batch = random_batch([3, 5, 4], 64)

    def broken(outputs: Any, micro_batch: Any, ctx: Any) -> Any:
        if ctx.micro_batch_index == 1:
            raise RuntimeError("loss exploded")
        return value_regression_loss(outputs, micro_batch, ctx)

    before = parameters(critic)
    with pytest.raises(RuntimeError, match="loss exploded"):
        critic.train_batch(batch, broken)
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(critic), strict=True))
    first = critic.train_batch(batch, value_regression_loss)["loss"]
    second = critic.train_batch(batch, value_regression_loss)["loss"]
    assert second < first


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (1.0, r"must return \(loss, metrics\)"),
        ((torch.ones(2), {}), "must be a scalar tensor"),
        ((torch.ones(()), [1]), "metrics must be a mapping"),
    ],
)
def test_a_loss_function_returning_the_wrong_shape_of_result_is_named(
    critic: Engine, result: Any, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        critic.train_batch(random_batch([3, 5], 64), lambda outputs, batch, ctx: result)


def test_a_sequence_longer_than_the_token_budget_is_named_with_its_length(
    fresh_mesh: None,
) -> None:
    engine = Engine.build(
        head="value", device="cpu", config={**CONFIG, "max_tokens_per_micro_batch": 10}
    ).initialize()
    with pytest.raises(BatchError, match=r"sequence 1 has 12 tokens, more than .*=10"):
        engine.train_batch(random_batch([4, 12, 3], 64), value_regression_loss)
    assert engine.train_batch(random_batch([4, 9, 3], 64), value_regression_loss)["loss"] >= 0
