"""Supervised losses: next-token likelihood (LM head) and value regression (value head)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.losses.aggregation import masked_mean, scored_mask, token_mean
from engine.losses.contract import (
    LossContext,
    needs_fields,
    needs_outputs,
    scalar_output,
    token_separable,
)
from heads.base import PER_TOKEN


@token_separable
@needs_fields()
@needs_outputs("log_probs")
def sft_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the masked tokens, global token mean (LM head)."""
    mask, key = scored_mask(batch)
    log_probs = scalar_output(outputs, "log_probs", PER_TOKEN, "sft_loss")
    loss = -token_mean(log_probs, mask, ctx.global_count(key))
    return loss, {"sft_loss": loss.detach()}


@needs_fields(returns=PER_TOKEN)
@needs_outputs("values")
def value_regression_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``0.5 * (values - returns)^2``, global token mean over the masked tokens (value head)."""
    mask, key = scored_mask(batch)
    values = scalar_output(outputs, "values", PER_TOKEN, "value_regression_loss")
    loss = 0.5 * token_mean(
        (values - batch["returns"].to(values.dtype)) ** 2, mask, ctx.global_count(key)
    )
    vpred = masked_mean(values.detach(), mask)
    return loss, {"vf_loss": loss.detach(), "vpred_mean": vpred}
