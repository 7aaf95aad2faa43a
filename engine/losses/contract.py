"""The loss-function contract: ``loss_fn(outputs, batch, ctx) -> (loss, metrics)``.

``outputs`` are the head's per-token results and ``batch`` the micro-batch's fields, both
right-padded ``[b, s]``; ``ctx`` tells the micro-batch's place in the global batch. A loss is
normalised by *global* counts (``ctx.global_count``), so the micro-batch losses add up to the
batch loss and the gradient does not depend on how the batch was split or on the
data-parallel size (gradients are summed over micro-batches and data-parallel ranks).

Metrics are this micro-batch's *local* statistics (numbers or one-element tensors); the engine
averages them over micro-batches. Only the returned loss is the micro-batch's share of the
global value, and when training it must be computed from the outputs (not detached).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch

from heads.errors import BatchError, ConfigError

LOSS_MASK = "loss_mask"
RESPONSE_MASK = "response_mask"
#: Count key for the tokens that have a prediction (every token but each sequence's first).
SCORED_TOKENS = "scored_tokens"
SEQUENCES = "sequences"

LossResult = tuple[torch.Tensor, dict[str, float]]


@attrs.frozen(kw_only=True)
class LossContext:
    """Where a micro-batch sits in the global batch."""

    micro_batch_index: int
    num_micro_batches: int
    data_parallel_size: int
    #: Global (all data-parallel ranks) sums: ``scored_tokens``, ``sequences`` and every
    #: per-token field whose name ends in ``mask``.
    global_counts: Mapping[str, float]

    def global_count(self, key: str) -> float:
        try:
            return self.global_counts[key]
        except KeyError:
            raise BatchError(
                f"no global count for {key!r}; the batch provides: {', '.join(self.global_counts)}"
            ) from None


LossFn = Callable[[Mapping[str, torch.Tensor], Any, LossContext], tuple[torch.Tensor, Any]]
F = TypeVar("F", bound=Callable[..., Any])


def needs_fields(*names: str) -> Callable[[F], F]:
    """Declare the batch fields a loss function reads; the batch is checked before any compute."""

    def declare(loss_fn: F) -> F:
        loss_fn.required_fields = names  # type: ignore[attr-defined]
        return loss_fn

    return declare


def required_fields(loss_fn: Any) -> tuple[str, ...]:
    """Batch fields ``loss_fn`` declares it needs (``required_fields`` attribute, if any)."""
    while hasattr(loss_fn, "func") and not hasattr(loss_fn, "required_fields"):
        loss_fn = loss_fn.func  # functools.partial
    return tuple(getattr(loss_fn, "required_fields", ()))


def checked_loss(result: Any, *, training: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """A loss function's ``(loss, metrics)``, checked: a one-element tensor (computed from the
    model's outputs when ``training``) and a mapping of names to numbers."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ConfigError(
            f"a loss function must return (loss, metrics); got {type(result).__name__}"
        )
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(f"a loss function's loss must be a scalar tensor; got {loss!r:.80}")
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            f"a loss function's metrics must be a mapping; got {type(metrics).__name__}"
        )
    if training and loss.grad_fn is None:
        raise ConfigError(
            "a loss function's loss is detached from the model (it has no gradient to the "
            "outputs): compute it from the outputs it is given, without .detach(), .item(), "
            "torch.no_grad() or a new torch.tensor(...)"
        )
    return loss.reshape(()), {str(name): _metric(name, value) for name, value in metrics.items()}


def _metric(name: object, value: object) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(
        f"loss metric {name!r} must be a number or a one-element tensor; got "
        f"{type(value).__name__} {value!r:.80}"
    )


def metrics_per_name(metrics: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per-micro-batch metric mappings -> ``{name: [value per micro-batch that reported it]}``."""
    names: dict[str, list[float]] = {}
    for entry in metrics:
        for name, value in entry.items():
            names.setdefault(name, []).append(float(value))
    return names
