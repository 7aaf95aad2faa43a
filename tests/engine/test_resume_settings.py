"""Optimizer and LR-schedule settings changed between runs are honoured on resume, never blended
with the checkpoint's: the next steps' lr is what a fresh run configured as the resuming engine
uses at those steps, a step's update is AdamW's with the new weight decay, betas, eps and
clipping, and the optimizer's state (Adam moments, step counts) is the checkpoint's. Both
backends, megatron's distributed optimizer too; one checkpoint per backend, shared by the
module's tests."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Engine
from engine.losses import sft_loss
from strategies.backends.megatron.mesh import destroy_mesh
from tests.factories import random_batch, tiny_model
from tests.tolerances import EPS32

LENGTHS = [5, 7, 9, 4]
VOCAB = 64
#: (backend, its options) by name.
VARIANTS = {
    "megatron": ("megatron", {}),
    "megatron-distributed-optimizer": ("megatron", {"use_distributed_optimizer": True}),
    "fsdp2": ("fsdp2", {}),
}
#: The saved run: warmup, then cosine decay to min_lr; clipping and weight decay on.
SAVED: dict[str, Any] = {
    "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0},
    "scheduler": {"warmup_steps": 2, "decay_style": "cosine"},
    "total_steps": 10,
}
SAVED_STEPS = 3
NEXT_STEPS = 3
#: Each change a user may make between runs (merged into SAVED), and what the warning names.
CHANGES: dict[str, tuple[dict[str, Any], str]] = {
    "lr": ({"optimizer": {"lr": 4e-4}}, "optimizer.lr 0.001 -> 0.0004"),
    "min_lr": ({"optimizer": {"min_lr": 5e-4}}, "optimizer.min_lr 0.0001 -> 0.0005"),
    "linear": ({"scheduler": {"decay_style": "linear"}}, "scheduler.decay_style cosine -> linear"),
    "constant": (
        {"scheduler": {"decay_style": "constant"}},
        "scheduler.decay_style cosine -> constant",
    ),
    "warmup_steps": ({"scheduler": {"warmup_steps": 5}}, "scheduler.warmup_steps 2 -> 5"),
    "decay_steps": ({"scheduler": {"decay_steps": 5}}, "scheduler.decay_steps None -> 5"),
    "total_steps": ({"total_steps": 4}, "total_steps 10 -> 4"),
    "weight_decay": ({"optimizer": {"weight_decay": 0.5}}, "optimizer.weight_decay 0.01 -> 0.5"),
    "clip_grad": ({"optimizer": {"clip_grad": 0.01}}, "optimizer.clip_grad 1.0 -> 0.01"),
    "no_clipping": ({"optimizer": {"clip_grad": 0.0}}, "optimizer.clip_grad 1.0 -> 0.0"),
    "betas_eps": (
        {"optimizer": {"adam_beta1": 0.5, "adam_beta2": 0.9, "adam_eps": 1e-3}},
        "optimizer.adam_beta1 0.9 -> 0.5, optimizer.adam_beta2 0.999 -> 0.9, "
        "optimizer.adam_eps 1e-08 -> 0.001",
    ),
    "everything": (
        {
            "optimizer": {"lr": 2e-3, "min_lr": 0.0, "weight_decay": 0.1, "clip_grad": 0.05},
            "scheduler": {"warmup_steps": 1, "decay_style": "linear", "decay_steps": 8},
            "total_steps": 20,
        },
        "optimizer.lr 0.001 -> 0.002",
    ),
}


def _settings(change: dict[str, Any]) -> dict[str, Any]:
    merged = {**SAVED, **change}
    for section in ("optimizer", "scheduler"):
        merged[section] = {**SAVED[section], **change.get(section, {})}
    return merged


def _engine(variant: str, settings: dict[str, Any]) -> Engine:
    backend, options = VARIANTS[variant]
    config = {"model": tiny_model(), "micro_batch_size": 2, "seed": 5, "backend": options}
    return Engine.build(
        head="lm", backend=backend, device="cpu", config={**config, **settings}
    ).initialize()


def _batch(step: int) -> Any:
    return random_batch(LENGTHS, VOCAB, seed=step)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().clone()


def _inner_optimizers(engine: Engine) -> list[torch.optim.Optimizer]:
    """The torch optimizers that step the weights (megatron's: inside each chained part)."""
    optimizer: Any = engine.backend._optimizer
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [getattr(part, "optimizer", part) for part in parts]


def _adam_state(engine: Engine) -> list[dict[str, torch.Tensor]]:
    """Each parameter's Adam moments and step count, in the optimizers' order."""
    return [
        {key: _local(value) for key, value in optimizer.state[param].items()}
        for optimizer in _inner_optimizers(engine)
        for group in optimizer.param_groups
        for param in group["params"]
    ]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, list[dict[str, torch.Tensor]]]]:
    """(variant, a checkpoint of the SAVED run after SAVED_STEPS steps, its Adam state)."""
    variant = request.param
    destroy_mesh()
    engine = _engine(variant, SAVED)
    for step in range(SAVED_STEPS):
        engine.train_batch(_batch(step), sft_loss)
    directory = Path(engine.save_checkpoint(tmp_path_factory.mktemp(variant)))
    yield variant, directory, _adam_state(engine)
    destroy_mesh()


def _schedule_lr(settings: dict[str, Any], step: int) -> float:
    """The schedule ``SchedulerConfig`` describes, written out: linear warmup from 0, then
    constant, linear or cosine decay to min_lr over decay_steps (default total_steps), min_lr
    after."""
    opt, schedule = settings["optimizer"], settings["scheduler"]
    lr, min_lr, warmup = opt["lr"], opt["min_lr"], schedule["warmup_steps"]
    decay = schedule.get("decay_steps") or max(settings["total_steps"], warmup + 1)
    if warmup and step <= warmup:
        return float(lr * step / warmup)
    if schedule["decay_style"] == "constant":
        return float(lr)
    if step > decay:
        return float(min_lr)
    ratio = (step - warmup) / (decay - warmup)
    coeff = (
        1.0 - ratio
        if schedule["decay_style"] == "linear"
        else 0.5 * (math.cos(math.pi * ratio) + 1)
    )
    return float(min_lr + coeff * (lr - min_lr))


def _fresh_lrs(variant: str, settings: dict[str, Any]) -> list[float]:
    """The lr a fresh run configured with ``settings`` uses at each of the steps after
    SAVED_STEPS."""
    fresh = _engine(variant, settings)
    for _ in range(SAVED_STEPS):
        fresh.lr_scheduler_step()
    lrs = []
    for _ in range(NEXT_STEPS):
        lrs.append(fresh.backend.current_lr())
        fresh.lr_scheduler_step()
    return lrs


def _next_steps() -> range:
    return range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS)


def _checked_step(engine: Engine, settings: dict[str, Any], step: int) -> float:
    """Training step ``step``, whose every weight is checked against AdamW with ``settings``'
    weight decay, betas, eps and clipping, from the weights, gradients and Adam state before
    it. Returns the lr it used."""
    opt = settings["optimizer"]
    engine.optimizer_zero_grad()
    engine.forward_backward_batch(_batch(step), sft_loss, return_outputs=False)
    engine.backend.grad_norm()  # megatron hands its gradients to the optimizer here
    lr = engine.backend.current_lr()
    before = [
        (param, _local(param), _local(param.grad), optimizer.state[param], group["wd_mult"])
        for optimizer in _inner_optimizers(engine)
        for group in optimizer.param_groups
        for param in group["params"]
    ]
    moments = [
        {key: _local(value).double() for key, value in state.items()}
        for _, _, _, state, _ in before
    ]
    norm = engine.optimizer_step()
    clip = opt["clip_grad"]
    factor = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    beta1, beta2 = opt.get("adam_beta1", 0.9), opt.get("adam_beta2", 0.999)
    eps = opt.get("adam_eps", 1e-8)
    for (param, weight, grad, _, wd_mult), state in zip(before, moments, strict=True):
        weight, grad = weight.double(), grad.double() * factor
        count = float(state["step"]) + 1
        exp_avg = beta1 * state["exp_avg"] + (1 - beta1) * grad
        exp_avg_sq = beta2 * state["exp_avg_sq"] + (1 - beta2) * grad * grad
        denom = exp_avg_sq.sqrt() / math.sqrt(1 - beta2**count) + eps
        step_size = lr / (1 - beta1**count)
        decay = opt["weight_decay"] * wd_mult
        expected = weight * (1 - lr * decay) - step_size * exp_avg / denom
        # AdamW rounds each coordinate about 8 times in float32 (the clipping, the moments,
        # the square root, the bias corrections, the decay and the update): twice that many
        # float32 epsilons of the magnitudes it combines
        scale = weight.abs() + step_size * (state["exp_avg"].abs() + grad.abs()) / denom
        gap = (_local(param).double() - expected).abs() - 16 * EPS32 * scale
        assert float(gap.max()) <= 0.0, f"update off by {float(gap.max())} beyond rounding"
    engine.lr_scheduler_step()
    return lr


def _assert_same_state(
    got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]
) -> None:
    assert len(got) == len(expected) > 0
    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours.keys() == theirs.keys() >= {"exp_avg", "exp_avg_sq", "step"}, index
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), f"parameter {index} {key}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_setting_changed_between_runs_is_honoured_from_the_resumed_step_on(
    saved: tuple[str, Path, list[dict[str, torch.Tensor]]], change: str
) -> None:
    variant, directory, saved_state = saved
    overrides, named = CHANGES[change]
    settings = _settings(overrides)
    resumed = _engine(variant, settings)
    with pytest.warns(UserWarning, match="settings changed since it was saved") as caught:
        resumed.load_checkpoint(directory)
    (message,) = [str(w.message) for w in caught if "settings changed" in str(w.message)]
    assert named in message
    assert resumed.global_step == SAVED_STEPS
    _assert_same_state(_adam_state(resumed), saved_state)

    used = [_checked_step(resumed, settings, step) for step in _next_steps()]
    assert used == _fresh_lrs(variant, settings)
    written_out = [_schedule_lr(settings, step) for step in _next_steps()]
    for lr, expected in zip(used, written_out, strict=True):
        assert math.isclose(lr, expected, rel_tol=8 * torch.finfo(torch.float64).eps)


@pytest.mark.timeout(120)
def test_a_resume_with_unchanged_settings_says_nothing_and_keeps_the_saved_state(
    saved: tuple[str, Path, list[dict[str, torch.Tensor]]],
) -> None:
    variant, directory, saved_state = saved
    resumed = _engine(variant, SAVED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_checkpoint(directory)
    assert not [w for w in caught if "settings changed" in str(w.message)]
    _assert_same_state(_adam_state(resumed), saved_state)
    used = [_checked_step(resumed, SAVED, step) for step in _next_steps()]
    assert used == _fresh_lrs(variant, SAVED)
