"""Loss functions: ``loss_fn(outputs, batch, ctx) -> (loss, metrics)``.

``outputs`` are the head's per-token results and ``batch`` the micro-batch's fields, both
right-padded ``[b, s]``; ``ctx`` tells the micro-batch's place in the global batch. A loss is
normalised by *global* counts (``ctx.global_count``), so the micro-batch losses add up to the
batch loss and the gradient does not depend on how the batch was split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from heads.errors import BatchError

LOSS_MASK = "loss_mask"
#: Count key for the tokens that have a prediction (every token but each sequence's first).
SCORED_TOKENS = "scored_tokens"
SEQUENCES = "sequences"


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


def scored_mask(batch: Any) -> tuple[torch.Tensor, str]:
    """The batch's ``loss_mask`` if it has one, else every token with a prediction; and the
    key of its global count."""
    if LOSS_MASK in batch.keys():
        return batch[LOSS_MASK].float(), LOSS_MASK
    mask = batch["attention_mask"].float().clone()
    mask[:, 0] = 0.0
    return mask, SCORED_TOKENS


def token_mean(values: torch.Tensor, mask: torch.Tensor, count: float) -> torch.Tensor:
    """This micro-batch's share of the global token mean; masked-out NaN/inf never leak in."""
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (masked * mask).sum() / max(count, 1.0)


def sft_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the masked tokens, global token mean (LM head)."""
    mask, key = scored_mask(batch)
    loss = -token_mean(outputs["log_probs"], mask, ctx.global_count(key))
    return loss, {"sft_loss": float(loss.detach())}


sft_loss.required_fields = ()  # type: ignore[attr-defined]


def value_regression_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * (values - returns)^2``, global token mean over the masked tokens (value head)."""
    mask, key = scored_mask(batch)
    values = outputs["values"]
    loss = 0.5 * token_mean(
        (values - batch["returns"].to(values.dtype)) ** 2, mask, ctx.global_count(key)
    )
    vpred = token_mean(values.detach(), mask, float(mask.sum()))
    return loss, {"vf_loss": float(loss.detach()), "vpred_mean": float(vpred)}


value_regression_loss.required_fields = ("returns",)  # type: ignore[attr-defined]


def required_fields(loss_fn: Any) -> tuple[str, ...]:
    """Batch fields ``loss_fn`` declares it needs (``required_fields`` attribute, if any)."""
    while hasattr(loss_fn, "func") and not hasattr(loss_fn, "required_fields"):
        loss_fn = loss_fn.func  # functools.partial
    return tuple(getattr(loss_fn, "required_fields", ()))
