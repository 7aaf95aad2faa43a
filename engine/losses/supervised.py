"""Supervised losses: next-token likelihood (LM head) and value regression (value head)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.losses.aggregation import scored_mask, token_mean
from engine.losses.contract import LossContext, needs_fields, scalar_output
from heads.base import PER_TOKEN


@needs_fields()
def sft_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the masked tokens, global token mean (LM head)."""
    mask, key = scored_mask(batch)
    log_probs = scalar_output(outputs, "log_probs", PER_TOKEN, "sft_loss")
    loss = -token_mean(log_probs, mask, ctx.global_count(key))
    return loss, {"sft_loss": float(loss.detach())}


@needs_fields(returns=PER_TOKEN)
def value_regression_loss(
    outputs: Mapping[str, torch.Tensor], batch: Any, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * (values - returns)^2``, global token mean over the masked tokens (value head)."""
    mask, key = scored_mask(batch)
    values = scalar_output(outputs, "values", PER_TOKEN, "value_regression_loss")
    loss = 0.5 * token_mean(
        (values - batch["returns"].to(values.dtype)) ** 2, mask, ctx.global_count(key)
    )
    vpred = token_mean(values.detach(), mask, float(mask.sum()))
    return loss, {"vf_loss": float(loss.detach()), "vpred_mean": float(vpred)}
