"""KL coefficient controllers for a KL penalty in the reward: fixed, or adapted towards a target
KL (the controller of Ziegler et al. 2019, used by PPO trainers for RLHF)."""

from __future__ import annotations

from typing import Protocol

import attrs

from heads.errors import ConfigError
from heads.validation import float_field, int_field, positive

#: The adaptive controller's proportional error is clipped to ``[-MAX_ERROR, MAX_ERROR]``.
MAX_ERROR = 0.2


class KLController(Protocol):
    """Holds the KL coefficient ``value`` and updates it after each rollout."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> None: ...


@attrs.frozen(kw_only=True)
class FixedKLController:
    """A constant coefficient."""

    value: float = float_field(0.01)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


@attrs.define(kw_only=True, on_setattr=attrs.setters.NO_OP)
class AdaptiveKLController:
    """Moves ``value`` towards the coefficient that keeps the KL at ``target``:
    ``e = clip(current_kl / target - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``
    (``n_steps``: samples in the rollout, ``horizon``: samples over which to reach the target).
    """

    value: float = float_field(0.01, positive)
    target: float = float_field(6.0, positive)
    horizon: int = int_field(10_000)

    def check_horizon(self, n_steps: int, name: str = "AdaptiveKLController.horizon") -> None:
        """ConfigError unless ``horizon`` exceeds ``MAX_ERROR`` x ``n_steps`` (the samples per
        update); ``name``: what the error calls the horizon."""
        if n_steps * MAX_ERROR >= self.horizon:
            raise ConfigError(
                f"{name} ({self.horizon}) must exceed {MAX_ERROR:g} x the samples per update "
                f"({n_steps}), or one update can zero or flip the coefficient"
            )

    def update(self, current_kl: float, n_steps: int) -> None:
        self.check_horizon(n_steps)
        error = min(max(current_kl / self.target - 1.0, -MAX_ERROR), MAX_ERROR)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_controller(
    kind: str, coeff: float, *, target: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """``fixed`` (``coeff`` throughout) or ``adaptive`` (starting at ``coeff``, needs ``target``
    and ``horizon``)."""
    if kind == "fixed":
        return FixedKLController(value=coeff)
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ConfigError(
                f"the adaptive KL controller needs target and horizon; got target={target!r}, "
                f"horizon={horizon!r}"
            )
        return AdaptiveKLController(value=coeff, target=target, horizon=horizon)
    raise ConfigError(f"KL controller must be 'fixed' or 'adaptive'; got {kind!r}")
