"""Value head: one scalar per token for critics and reward models."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import attrs
import torch

from heads.base import (
    PER_TOKEN,
    Granularity,
    HeadContext,
    OutputSpec,
    next_tokens,
    shift_to_scored_token,
)


@attrs.frozen(kw_only=True)
class ValueHead:
    """Critic / reward head: ``values[t] = V(x_<t)``, from a replicated ``hidden -> 1`` layer.

    The layer is never tied to the embedding and never loaded from an LM checkpoint's
    ``lm_head`` (it is new, or a token classifier checkpoint's ``score``, as which it is
    exported); values are float32 whatever the model's dtype.
    """

    name: ClassVar[str] = "value"

    @property
    def outputs(self) -> dict[str, Granularity]:
        return {"values": PER_TOKEN}

    def output_spec(self) -> OutputSpec:
        return OutputSpec(kind="replicated", features=1)

    def postprocess(
        self, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        return self.place(self.per_position(raw, next_tokens(input_ids), ctx), ctx)

    def per_position(
        self, raw: torch.Tensor, next_tokens: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        return {"values": raw[..., 0].float()}

    def place(
        self, per_position: Mapping[str, torch.Tensor], ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        return {"values": shift_to_scored_token(per_position["values"], ctx)}
