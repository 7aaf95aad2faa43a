"""The Head protocol: what a model outputs and how raw outputs become per-token results."""

from __future__ import annotations

from typing import ClassVar, Literal, Protocol, runtime_checkable

import attrs
import torch

from heads.errors import ConfigError


@attrs.frozen(kw_only=True)
class OutputSpec:
    """What the backend must build as the model's last layer.

    ``vocab``: the language-model output layer over the vocabulary (vocab-parallel under tensor
    parallelism; may share the input embedding). ``replicated``: a new ``hidden -> features``
    layer, identical on every tensor-parallel rank, never tied to the embedding.
    """

    kind: Literal["vocab", "replicated"]
    features: int = 0
    allow_tied_embeddings: bool = False
    #: dtype of the per-token results the head returns.
    result_dtype: torch.dtype = torch.float32

    def __attrs_post_init__(self) -> None:
        if self.kind == "replicated" and self.features <= 0:
            raise ConfigError(f"a replicated output layer needs features > 0, got {self.features}")
        if self.kind == "replicated" and self.allow_tied_embeddings:
            raise ConfigError("a replicated output layer cannot be tied to the embedding")


@attrs.frozen(kw_only=True)
class HeadContext:
    """What the backend tells a head about the layout of the raw output it hands over."""

    #: Tensor-parallel group when the raw output is split over the vocabulary, else None.
    tensor_parallel_group: torch.distributed.ProcessGroup | None = None
    #: First vocabulary index held by this rank's shard of the logits.
    vocab_start: int = 0


@runtime_checkable
class Head(Protocol):
    """A model head. Built-ins: ``heads.lm.LMHead`` and ``heads.value.ValueHead``.

    ``postprocess`` receives the raw output ``[batch, seq, features]`` of the layer built from
    ``output_spec()`` and the token ids ``[batch, seq]``; it returns per-token results
    ``[batch, seq]`` aligned with the token they score: entry ``t`` comes from the hidden state
    at ``t - 1``, and entry 0 of every row is 0.
    """

    name: ClassVar[str]

    @property
    def output_keys(self) -> tuple[str, ...]:
        """Names of the per-token results ``postprocess`` returns."""
        ...

    def output_spec(self) -> OutputSpec: ...

    def postprocess(
        self, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]: ...


def shift_to_scored_token(per_position: torch.Tensor) -> torch.Tensor:
    """Move results computed at position ``t - 1`` to the token ``t`` they score (entry 0 := 0)."""
    shifted = torch.zeros_like(per_position)
    shifted[:, 1:] = per_position[:, :-1]
    return shifted
