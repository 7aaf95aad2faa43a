"""Reward-model head: one score per sequence, read at each sequence's own last token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import attrs
import torch

from heads.base import (
    PER_SEQUENCE,
    Granularity,
    HeadContext,
    OutputSpec,
    at_last_token,
    next_tokens,
)


@attrs.frozen(kw_only=True)
class RewardHead:
    """Reward model head: ``scores[b]`` from a replicated ``hidden -> 1`` layer applied to the
    hidden state of row ``b``'s last real token (whatever the padding or micro-batching).

    Like the value head's, the layer is never tied to the embedding nor loaded from an LM
    checkpoint's ``lm_head`` (it is new, or a sequence classifier checkpoint's ``score``, as
    which it is exported); scores are float32. Train it with a pairwise Bradley-Terry loss
    (``engine.losses.bradley_terry_loss``) or a regression loss (``score_regression_loss``).
    """

    name: ClassVar[str] = "reward"

    @property
    def outputs(self) -> dict[str, Granularity]:
        return {"scores": PER_SEQUENCE}

    def output_spec(self) -> OutputSpec:
        return OutputSpec(kind="replicated", features=1)

    def postprocess(
        self, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        return self.place(self.per_position(raw, next_tokens(input_ids), ctx), ctx)

    def per_position(
        self, raw: torch.Tensor, next_tokens: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        return {"scores": raw[..., 0].float()}

    def place(
        self, per_position: Mapping[str, torch.Tensor], ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        return {"scores": at_last_token(per_position["scores"], ctx)}
