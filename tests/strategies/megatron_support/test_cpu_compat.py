"""The CPU layer: megatron code under its cuda->cpu mode, model compute without it, and the
megatron-core releases it accepts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from heads.errors import VersionError
from strategies.megatron_support import cpu_compat, version
from strategies.megatron_support.cpu_compat import (
    enable_megatron_cpu_compat,
    run_forward_step,
    run_schedule,
    run_scoped,
    run_unscoped,
)


def under_the_mode() -> bool:
    """Whether the mode is on, seen from outside: tensors report cuda type strings."""
    return torch.zeros(1).type() == "torch.cuda.FloatTensor"


def test_scoped_functions_run_under_the_mode_and_unscoped_ones_without_it() -> None:
    assert not under_the_mode()
    assert run_scoped(under_the_mode)()
    assert not run_scoped(run_unscoped(under_the_mode))()
    assert not under_the_mode()


def test_a_schedule_runs_under_the_mode_but_its_forward_step_and_loss_function_do_not() -> None:
    seen: list[tuple[str, bool]] = []

    def loss_func() -> None:
        seen.append(("loss", under_the_mode()))

    def forward_step() -> tuple[str, Callable[[], None]]:
        seen.append(("forward step", under_the_mode()))
        return "output", loss_func

    def schedule(*, forward_step_func: Callable[[], tuple[str, Callable[[], None]]]) -> str:
        seen.append(("schedule", under_the_mode()))
        output, loss = forward_step_func()
        loss()
        return output

    assert run_schedule(schedule)(forward_step_func=forward_step) == "output"
    assert seen == [("schedule", True), ("forward step", False), ("loss", False)]


@pytest.mark.parametrize("wrap", [run_scoped, run_unscoped, run_forward_step, run_schedule])
def test_wrapping_a_wrapped_function_again_returns_it_unchanged(wrap: Any) -> None:
    wrapped = wrap(under_the_mode)
    assert wrap(wrapped) is wrapped


def test_a_megatron_core_outside_the_tested_range_is_refused_naming_the_cpu_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(cpu_compat._state, "enabled", False)
    monkeypatch.setattr(version, "version", lambda package: "0.15.3")
    with pytest.raises(VersionError) as raised:
        enable_megatron_cpu_compat()
    assert str(raised.value).startswith(
        "megatron-core 0.15.3 is installed, but the megatron-core CPU compatibility layer is "
        "tested with >=0.16.1,<0.17 only"
    )
    assert "pip install 'megatron-core>=0.16.1,<0.17'" in str(raised.value)
