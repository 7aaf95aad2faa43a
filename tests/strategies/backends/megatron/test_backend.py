"""Megatron backend: optimizer variants, LR schedule, dtypes, forward-only builds."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine import Engine
from engine.losses import sft_loss, value_regression_loss
from heads.errors import ConfigError
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, tiny_model


def train_losses(config: dict[str, Any], head: str = "lm", steps: int = 4) -> list[float]:
    destroy_mesh()
    engine = Engine.build(head=head, device="cpu", config=config).initialize()
    loss = sft_loss if head == "lm" else value_regression_loss
    batches = [random_batch([6, 11, 3, 9], 64, seed=step) for step in range(steps)]
    with engine.train_mode():
        return [engine.train_batch(batch, loss)["loss"] for batch in batches]


@pytest.mark.parametrize("head", ["lm", "value"])
def test_the_distributed_optimizer_trains_like_the_plain_one(fresh_mesh: None, head: str) -> None:
    base = {"model": tiny_model(), "optimizer": {"lr": 1e-3}}
    plain = train_losses(base, head)
    distributed = train_losses({**base, "backend": {"use_distributed_optimizer": True}}, head)
    assert distributed == pytest.approx(plain, rel=1e-6, abs=1e-7)


def test_learning_rate_warms_up_linearly_then_decays_by_cosine(fresh_mesh: None) -> None:
    engine = Engine.build(
        head="lm",
        device="cpu",
        config={
            "model": tiny_model(),
            "optimizer": {"lr": 1e-3, "min_lr": 1e-4},
            "scheduler": {"warmup_steps": 2, "decay_style": "cosine", "decay_steps": 6},
        },
    ).initialize()
    seen = [engine.lr_scheduler_step() for _ in range(6)]
    expected = [5e-4, 1e-3]
    for step in (3, 4, 5, 6):
        progress = (step - 2) / 4
        expected.append(1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * progress)))
    assert seen == pytest.approx(expected, rel=1e-9)


def test_train_batch_reports_the_lr_it_used_and_advances_the_schedule(fresh_mesh: None) -> None:
    engine = Engine.build(
        head="lm",
        device="cpu",
        config={
            "model": tiny_model(),
            "optimizer": {"lr": 1e-3},
            "scheduler": {"warmup_steps": 4},
        },
    ).initialize()
    batch = random_batch([5, 7], 64)
    used = [engine.train_batch(batch, sft_loss)["lr"] for _ in range(3)]
    assert used == pytest.approx([0.0, 2.5e-4, 5e-4])
    assert engine.train_batch(batch, sft_loss, step_lr=False)["lr"] == pytest.approx(7.5e-4)
    assert engine.train_batch(batch, sft_loss)["lr"] == pytest.approx(7.5e-4)


def test_grad_clipping_bounds_the_update_and_reports_the_unclipped_norm(fresh_mesh: None) -> None:
    engine = Engine.build(
        head="value",
        device="cpu",
        config={"model": tiny_model(), "optimizer": {"lr": 1e-3, "clip_grad": 1e-6}},
    ).initialize()
    metrics = engine.train_batch(random_batch([5, 7], 64), value_regression_loss)
    assert metrics["grad_norm"] > 1e-3


@pytest.mark.parametrize(
    "options",
    [{}, {"backend": {"use_distributed_optimizer": True}}, {"dtype": "bfloat16"}],
    ids=["plain", "distributed-optimizer", "bfloat16"],
)
def test_a_clipped_step_leaves_the_weights_megatrons_own_optimizer_step_leaves(
    fresh_mesh: None, options: dict[str, Any]
) -> None:
    """The step reuses the gradient norm the non-finite guard measured; megatron's
    ``optimizer.step()`` measures it again. Same norm, same clipped weights, bit for bit."""
    config = {"model": tiny_model(), "optimizer": {"lr": 1e-2, "clip_grad": 0.05}, **options}
    batch = random_batch([6, 11, 3, 9], 64)
    ours = Engine.build(head="lm", device="cpu", config=config).initialize()
    grad_norm = ours.train_batch(batch, sft_loss)["grad_norm"]
    theirs = Engine.build(head="lm", device="cpu", config=config).initialize()
    theirs.forward_backward_batch(batch, sft_loss)
    _, their_norm, _ = theirs.backend._optimizer.step()
    assert grad_norm == their_norm > 0.05  # the clip engaged
    pairs = zip(ours.backend.modules(), theirs.backend.modules(), strict=True)
    for our_chunk, their_chunk in pairs:
        for (name, mine), other in zip(
            our_chunk.named_parameters(), their_chunk.parameters(), strict=True
        ):
            assert torch.equal(mine, other), name


def test_a_forward_only_engine_builds_no_optimizer_and_keeps_weights(fresh_mesh: None) -> None:
    reference = Engine.build(
        head="lm", device="cpu", config={"model": tiny_model(), "forward_only": True}
    ).initialize()
    before = [p.clone() for p in reference.backend.modules()[0].parameters()]
    reference.infer_batch(random_batch([5, 7], 64))
    after = list(reference.backend.modules()[0].parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(p.grad is None for p in after)


def test_value_head_never_ties_embeddings_and_lm_head_ties_when_asked(fresh_mesh: None) -> None:
    model = {**tiny_model(), "tie_embeddings": True}
    critic = Engine.build(head="value", device="cpu", config={"model": model}).initialize()
    actor = Engine.build(head="lm", device="cpu", config={"model": model}).initialize()
    critic_model, actor_model = critic.backend.modules()[0], actor.backend.modules()[0]
    assert critic_model.output_layer.weight.shape == (1, 32)
    assert not critic_model.share_embeddings_and_output_weights
    assert actor_model.share_embeddings_and_output_weights


def test_bfloat16_engines_train_and_return_float32_results(fresh_mesh: None) -> None:
    config = {"model": tiny_model(), "dtype": "bfloat16", "optimizer": {"lr": 1e-3}}
    losses = train_losses(config, "value", steps=3)
    assert all(math.isfinite(loss) for loss in losses)
    destroy_mesh()
    engine = Engine.build(head="value", device="cpu", config=config).initialize()
    assert engine.infer_batch(random_batch([4], 64))["values"].dtype == torch.float32


def test_megatron_only_settings_are_the_backends_own_options() -> None:
    from engine.config import EngineConfig
    from strategies.backends.megatron.backend import MegatronBackend

    for field in ("use_distributed_optimizer", "transformer_overrides"):
        with pytest.raises(ConfigError, match=rf"OptimizerConfig has no field\(s\) {field}"):
            EngineConfig.from_dict({"optimizer": {field: True}})
        with pytest.raises(ConfigError, match=rf"unknown ModelConfig field\(s\): {field}"):
            EngineConfig.from_dict({"model": {field: True}})
    engine = Engine.build(
        head="lm",
        device="cpu",
        config={"backend": {"use_distributed_optimizer": True, "transformer_overrides": {}}},
    )
    assert isinstance(engine.backend, MegatronBackend)
    assert engine.backend.use_distributed_optimizer


def test_unknown_transformer_overrides_are_refused_before_any_build_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"transformer_overrides: 'no_such_knob' is not a field"):
        Engine.build(
            head="lm",
            device="cpu",
            config={"backend": {"transformer_overrides": {"no_such_knob": 1}}},
        )


CPU_OPTIMIZER_OFFLOAD = {
    "optimizer_cpu_offload": True,
    "optimizer_offload_fraction": 1.0,
    "overlap_cpu_optimizer_d2h_h2d": True,
    "use_precision_aware_optimizer": True,
}


def test_cpu_optimizer_offload_on_the_cpu_platform_trains_like_the_plain_optimizer(
    fresh_mesh: None,
) -> None:
    """On the CPU platform the optimizer state and step are in host memory already, so
    megatron's CPU optimizer offload (and the precision-aware optimizer with its float32
    defaults) is the distributed optimizer's AdamW itself: the same losses exactly."""
    base = {
        "model": tiny_model(),
        "optimizer": {"lr": 1e-3},
        "backend": {"use_distributed_optimizer": True},
    }
    plain = train_losses(base)
    backend = {"use_distributed_optimizer": True, "optimizer_overrides": CPU_OPTIMIZER_OFFLOAD}
    assert train_losses({**base, "backend": backend}) == plain


def test_cpu_optimizer_offload_reaches_megatrons_optimizer_config_on_an_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off the host, each override is a field of the ``OptimizerConfig`` megatron builds its
    optimizer from (its offloading optimizer needs CUDA, so it is not built here)."""
    import megatron.core.optimizer as megatron_optimizer

    from strategies.backends.megatron.optimizer import build_optimizer, optimizer_overrides_on
    from strategies.part_configs import PartsConfig

    assert optimizer_overrides_on(True, CPU_OPTIMIZER_OFFLOAD) == {}
    offload = {k: v for k, v in CPU_OPTIMIZER_OFFLOAD.items() if k.startswith(("opt", "over"))}
    overrides = optimizer_overrides_on(False, offload)
    assert overrides == offload and len(offload) == 3
    seen: list[Any] = []
    monkeypatch.setattr(
        megatron_optimizer, "get_megatron_optimizer", lambda config, chunks: seen.append(config)
    )
    config = Engine.build(head="lm", device="cpu", config={"model": tiny_model()}).config
    parts: PartsConfig = config
    build_optimizer(parts, [], distributed=True, overrides=overrides)
    (built,) = seen
    for name, value in offload.items():
        assert getattr(built, name) == value, name


def test_precision_aware_optimizer_without_transformer_engine_is_refused_on_an_accelerator() -> (
    None
):
    import importlib.util

    from strategies.backends.megatron.optimizer import optimizer_overrides_on

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed: its fused Adam takes the setting")
    with pytest.raises(ConfigError, match="needs TransformerEngine"):
        optimizer_overrides_on(False, CPU_OPTIMIZER_OFFLOAD)


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ({"optimizer_overrides": {"optimizer": "sgd"}}, "unknown megatron OptimizerConfig field"),
        (
            {"optimizer_overrides": {"optimizer_cpu_offload": True}},
            "optimizer_cpu_offload=True needs use_distributed_optimizer=True",
        ),
        (
            {
                "use_distributed_optimizer": True,
                "optimizer_overrides": {"optimizer_offload_fraction": 1.5},
            },
            r"optimizer_offload_fraction=1.5 must be in \[0, 1\]",
        ),
        (
            {
                "use_distributed_optimizer": True,
                "optimizer_overrides": {"optimizer_cpu_offload": 1},
            },
            "optimizer_cpu_offload=1 must be a bool",
        ),
    ],
)
def test_bad_optimizer_overrides_are_refused_before_any_build(
    backend: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Engine.build(head="lm", device="cpu", config={"backend": backend})
