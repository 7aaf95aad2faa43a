"""The non-finite guard: a step whose loss, gradient norm or learning rate is NaN or infinite
never reaches the weights, and every rank takes the same decision."""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs
import torch
import torch.distributed as dist

from engine.config import NonFiniteConfig
from heads.errors import NonFiniteError
from strategies.parallel.collectives import all_reduce_values

#: Why a step with a zero gradient is skipped: AdamW would still move the weights (momentum,
#: weight decay) although the batch asked for nothing, e.g. when no token was scored.
ZERO_GRADIENT = "the gradient is zero (was any token scored?)"


@attrs.define
class NonFiniteGuard:
    """Decides whether an optimizer step runs, the same on every rank, and counts skips."""

    config: NonFiniteConfig
    #: Steps skipped so far, for any reason.
    skipped_steps: int = 0
    #: Non-finite steps since the last applied one, and the reason of the first of them.
    consecutive: int = 0
    first_reason: str = ""

    def reason_to_skip(self, values: Mapping[str, float | None]) -> str | None:
        """Why the step must be skipped, agreed over every rank (one all-reduce), or None.

        ``values``: the loss (None on ranks that hold no outputs), ``grad_norm`` and ``lr``.
        """
        names = list(values)
        codes = [_code(value) for value in values.values()]
        codes.append(int(values.get("grad_norm") == 0.0))
        agreed = all_reduce_values(codes, op=dist.ReduceOp.MAX, dtype=torch.int64)
        *flags, zero_gradient = (int(code) for code in agreed)
        found = [
            f"{name} is {_KIND[flag]}" for name, flag in zip(names, flags, strict=True) if flag
        ]
        if found:
            return ", ".join(found)
        return ZERO_GRADIENT if zero_gradient else None

    def counters(self) -> dict[str, int | str]:
        """What a checkpoint keeps of the guard (it resumes counting from there)."""
        return {
            "skipped_steps": self.skipped_steps,
            "consecutive": self.consecutive,
            "first_reason": self.first_reason,
        }

    def restore(self, counters: Mapping[str, object]) -> None:
        """Take up :meth:`counters` from a checkpoint; one without them (older) starts at 0."""
        skipped, consecutive = counters.get("skipped_steps", 0), counters.get("consecutive", 0)
        reason = counters.get("first_reason", "")
        self.skipped_steps = skipped if isinstance(skipped, int) else 0
        self.consecutive = consecutive if isinstance(consecutive, int) else 0
        self.first_reason = reason if isinstance(reason, str) else ""

    def record(self, reason: str | None) -> None:
        """Count the step's outcome; raise ``NonFiniteError`` where the policy says so."""
        if reason is None:
            self.consecutive, self.first_reason = 0, ""
            return
        self.skipped_steps += 1
        if reason == ZERO_GRADIENT:
            return
        self.consecutive += 1
        self.first_reason = self.first_reason or reason
        unchanged = "the weights, optimizer state and LR schedule are unchanged"
        if self.config.policy == "raise":
            raise NonFiniteError(
                f"optimizer step skipped: {reason} (NonFiniteConfig.policy='raise'); {unchanged}"
            )
        if self.consecutive > self.config.max_consecutive_skips:
            raise NonFiniteError(
                f"{self.consecutive} optimizer steps in a row skipped for non-finite values, "
                f"more than NonFiniteConfig.max_consecutive_skips "
                f"({self.config.max_consecutive_skips}); the first: {self.first_reason}; the "
                f"last: {reason}. Since the last applied step {unchanged}"
            )


_KIND = {1: "inf", 2: "nan"}


def _code(value: float | None) -> int:
    """0: finite or unknown here, 1: infinite, 2: NaN (the all-reduce keeps the worst)."""
    if value is None or math.isfinite(value):
        return 0
    return 2 if math.isnan(value) else 1
