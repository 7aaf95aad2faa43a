"""Value head: one scalar per token for critics and reward models."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from heads.base import PER_TOKEN, Granularity, HeadContext, OutputSpec, shift_to_scored_token


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
        return {"values": shift_to_scored_token(raw[..., 0].float(), ctx)}
