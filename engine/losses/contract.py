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

from heads.base import PER_SEQUENCE, PER_TOKEN, Granularity
from heads.errors import BatchError, ConfigError

LOSS_MASK = "loss_mask"
RESPONSE_MASK = "response_mask"
#: Count key for the tokens that have a prediction (every token but each sequence's first).
SCORED_TOKENS = "scored_tokens"
SEQUENCES = "sequences"

LossResult = tuple[torch.Tensor, dict[str, float | torch.Tensor]]


@attrs.frozen(kw_only=True)
class LossContext:
    """Where a micro-batch sits in the global batch."""

    micro_batch_index: int
    num_micro_batches: int
    data_parallel_size: int
    #: Global (all data-parallel ranks) sums: ``scored_tokens``, ``sequences`` and every
    #: per-token field whose name ends in ``mask``. Numbers; a one-element tensor where a count
    #: is left on the device (``aggregation.local_context``, for this micro-batch's metrics).
    global_counts: Mapping[str, float | torch.Tensor]
    #: The micro-batch's rows: their indices in this rank's batch, ``[b]`` (host; None where
    #: a context is made outside a step).
    rows: torch.Tensor | None = None

    def global_count(self, key: str) -> float | torch.Tensor:
        try:
            return self.global_counts[key]
        except KeyError:
            raise BatchError(
                f"no global count for {key!r}; the batch provides: {', '.join(self.global_counts)}"
            ) from None


LossFn = Callable[[Mapping[str, torch.Tensor], Any, LossContext], tuple[torch.Tensor, Any]]
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def needs_fields(*names: str, **granularity: Granularity) -> Callable[[F], F]:
    """Declare the batch fields a loss function reads; the batch is checked before any compute.

    ``needs_fields("pair_id")`` accepts the field in either layout; ``needs_fields(returns=
    PER_TOKEN)`` also checks that it is per-token (``PER_SEQUENCE``: one value per row), so a
    ``[B]`` field handed to a per-token loss is refused by name rather than failing (or, when
    ``B`` equals the width, broadcasting silently) inside the loss."""
    declared: dict[str, Granularity | None] = {**dict.fromkeys(names), **granularity}
    _check_declared(declared, "needs_fields")

    def declare(loss_fn: F) -> F:
        loss_fn.required_fields = declared  # type: ignore[attr-defined]
        return loss_fn

    return declare


def declared_fields(loss_fn: Any) -> dict[str, Granularity | None]:
    """``{field: granularity}`` that ``loss_fn`` declares in its ``required_fields`` attribute
    (looked up through ``functools.partial``): a mapping of names to ``PER_TOKEN``,
    ``PER_SEQUENCE`` or None (either layout), or plain names (either layout)."""
    while hasattr(loss_fn, "func") and not hasattr(loss_fn, "required_fields"):
        loss_fn = loss_fn.func  # functools.partial
    fields = getattr(loss_fn, "required_fields", ())
    if isinstance(fields, Mapping):
        declared = {str(name): value for name, value in fields.items()}
    else:
        declared = dict.fromkeys(fields)
    owner = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
    _check_declared(declared, f"{owner}.required_fields")
    return declared


def required_fields(loss_fn: Any) -> tuple[str, ...]:
    """Batch fields ``loss_fn`` declares it needs (``required_fields`` attribute, if any)."""
    return tuple(declared_fields(loss_fn))


def needs_outputs(*names: str) -> Callable[[F], F]:
    """Declare the head outputs a loss function reads (``log_probs``, ``entropy``, ...): the
    engine checks them against the head's before any compute, so a missing one is refused by
    name at the start of the step, not deep inside a backend's schedule."""

    def declare(loss_fn: F) -> F:
        loss_fn.required_outputs = tuple(names)  # type: ignore[attr-defined]
        return loss_fn

    return declare


def required_outputs(loss_fn: Any) -> tuple[str, ...]:
    """The head outputs ``loss_fn`` declares it reads (``required_outputs``, an attribute or
    property; looked up through ``functools.partial``); none if undeclared."""
    while hasattr(loss_fn, "func") and not hasattr(loss_fn, "required_outputs"):
        loss_fn = loss_fn.func  # functools.partial
    return tuple(getattr(loss_fn, "required_outputs", ()))


def field_granularity(loss_fn: Any) -> dict[str, Granularity]:
    """The declared fields whose layout ``loss_fn`` fixes (``PER_TOKEN`` / ``PER_SEQUENCE``)."""
    return {name: value for name, value in declared_fields(loss_fn).items() if value is not None}


def token_separable(loss_fn: F) -> F:
    """Declare ``loss_fn`` token-separable: its gradient w.r.t. a token's outputs depends on that
    token's outputs (and the batch) only, never on another token's outputs. A sum of per-token
    terms weighted by batch-only numbers (masks, advantages, global counts) is; a loss pooling
    outputs over a sequence (GSPO's ratio) or over the batch (a normalisation by the outputs)
    is not. A fused LM head then computes the loss's gradient in its forward pass, chunk by
    chunk, asking the loss for it with only one chunk's outputs real (zeros elsewhere), and
    needs no recomputation in backward (``LMHead.gradient_in_forward``). The loss is then
    called several times per micro-batch (once per chunk, and twice with every output: for
    the check below and for its value and metrics), so it must have no side effects. A loss
    declared separable that is not would get wrong gradients: the head compares each chunk's
    gradient with the one with every token real, and a mismatch refuses the step
    (ConfigError, before the optimizer step)."""
    loss_fn.token_separable = True  # type: ignore[attr-defined]
    return loss_fn


def is_token_separable(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` declares itself token-separable (:func:`token_separable`, or a
    ``token_separable`` attribute or property; looked up through ``functools.partial``)."""
    while hasattr(loss_fn, "func") and not hasattr(loss_fn, "token_separable"):
        loss_fn = loss_fn.func  # functools.partial
    return getattr(loss_fn, "token_separable", False) is True


def _check_declared(declared: Mapping[str, object], where: str) -> None:
    for name, value in declared.items():
        if value not in (PER_TOKEN, PER_SEQUENCE, None):
            raise ConfigError(
                f"{where}: field {name!r} has granularity {value!r}; it must be "
                f"{PER_TOKEN!r} (per token), {PER_SEQUENCE!r} (per sequence) or None (either)"
            )


def scalar_output(
    outputs: Mapping[str, torch.Tensor], key: str, granularity: Granularity, loss: str
) -> torch.Tensor:
    """``outputs[key]`` as a built-in loss reads it: one value per token (``[b, s]``) or per
    sequence (``[b]``). A head's output with trailing feature dims (``[b, s, k]``) is a
    ConfigError naming the loss and the key, never a silent broadcast against ``[b, s]``
    fields; a missing output names what the head gives."""
    if key not in outputs:
        raise ConfigError(
            f"{loss} reads the head's output {key!r}; the head gives: "
            f"{', '.join(map(repr, outputs)) or 'nothing'}"
        )
    value = outputs[key]
    dims = 2 if granularity == PER_TOKEN else 1
    if value.dim() != dims:
        layout = "[b, s]" if granularity == PER_TOKEN else "[b]"
        raise ConfigError(
            f"{loss} reads the head's output {key!r} as one value per {granularity} {layout}; "
            f"the head gives shape {list(value.shape)} (trailing feature dims): reduce the "
            "features to one value per entry in a loss of your own (see docs/custom-heads.md)"
        )
    return value


def checked_loss(
    result: Any, *, training: bool
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """A loss function's ``(loss, metrics)``, checked: a one-element tensor (computed from the
    model's outputs when ``training``) and a mapping of names to numbers. A metric given as a
    one-element tensor stays one (detached, 0-dim): the engine brings every number of a step to
    the host in one transfer at its end (``engine.host_values``), so a loss function should not
    call ``float()`` / ``.item()`` on device values itself."""
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


def _metric(name: object, value: object) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(
        f"loss metric {name!r} must be a number or a one-element tensor; got "
        f"{type(value).__name__} {value!r:.80}"
    )


def metrics_per_name(metrics: Sequence[Mapping[str, T]]) -> dict[str, list[T]]:
    """Per-micro-batch metric mappings -> ``{name: [value per micro-batch that reported it]}``."""
    names: dict[str, list[T]] = {}
    for entry in metrics:
        for name, value in entry.items():
            names.setdefault(name, []).append(value)
    return names
