"""The Head protocol: what a model outputs and how raw outputs become per-token or
per-sequence results, and the checks that hold every head to it."""

from __future__ import annotations

from collections.abc import Mapping
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
    #: dtype of the results the head returns.
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
    #: Real tokens of each row of the raw output (rows are right-padded); set by the engine.
    sequence_lengths: torch.Tensor | None = None


#: A result's layout: one value per token, aligned to the token it scores (``[batch, seq]``),
#: or one value per sequence (``[batch]``), taken at each sequence's own last token.
Granularity = Literal["token", "sequence"]
PER_TOKEN: Granularity = "token"
PER_SEQUENCE: Granularity = "sequence"


@runtime_checkable
class Head(Protocol):
    """A model head. Built-ins: ``heads.lm.LMHead``, ``heads.value.ValueHead`` and
    ``heads.reward.RewardHead``.

    ``postprocess`` receives the raw output ``[batch, seq, features]`` of the layer built from
    ``output_spec()`` and the token ids ``[batch, seq]`` (rows right-padded; real lengths in
    ``ctx.sequence_lengths``); it returns each result it declares in ``outputs``:

    * per token, ``[batch, seq]``, aligned with the token it scores: entry ``t`` comes from the
      hidden state at ``t - 1`` (:func:`shift_to_scored_token`) and entry 0 of every row is 0;
    * per sequence, ``[batch]``, taken at each row's last real token (:func:`at_last_token`).

    The engine checks every micro-batch's results against the declaration
    (:func:`check_results`).
    """

    name: ClassVar[str]

    @property
    def outputs(self) -> Mapping[str, Granularity]:
        """Each result's name and whether it is per token or per sequence."""
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


def at_last_token(per_position: torch.Tensor, ctx: HeadContext) -> torch.Tensor:
    """``per_position[b, last real token of row b]`` for right-padded rows ``[batch, seq]``."""
    rows = torch.arange(per_position.shape[0], device=per_position.device)
    if ctx.sequence_lengths is None:
        return per_position[:, -1]
    last = ctx.sequence_lengths.to(device=per_position.device, dtype=torch.long) - 1
    return per_position[rows, last]


def check_results(head: Head, results: Mapping[str, torch.Tensor], input_ids: torch.Tensor) -> None:
    """The results are what ``head.outputs`` declares: the same keys, ``[batch, seq]`` per-token
    results with nothing at position 0 (the shift to the scored token), ``[batch]``
    per-sequence ones. ConfigError naming the head and the key otherwise."""
    declared = head.outputs
    where = f"head {head.name!r}"
    if not isinstance(results, Mapping):
        raise ConfigError(f"{where}: postprocess must return a dict, got {type(results).__name__}")
    if set(results) != set(declared):
        missing = sorted(set(declared) - set(results))
        extra = sorted(set(results) - set(declared))
        raise ConfigError(
            f"{where} declares outputs {sorted(declared)} but postprocess returned "
            f"{sorted(results)} (missing: {missing or 'none'}, undeclared: {extra or 'none'})"
        )
    batch, length = input_ids.shape
    for key, granularity in declared.items():
        value = results[key]
        expected = [batch, length] if granularity == PER_TOKEN else [batch]
        if not isinstance(value, torch.Tensor) or list(value.shape) != expected:
            found = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(
                f"{where}: output {key!r} is declared per {granularity}, so it must have shape "
                f"{expected} for input_ids {[batch, length]}; got {found}"
            )
        if granularity == PER_TOKEN and bool(value[:, 0].ne(0).any()):
            raise ConfigError(
                f"{where}: per-token output {key!r} has a value at position 0; entry t must score "
                "token t from the hidden state at t - 1 (use heads.base.shift_to_scored_token), "
                "so position 0 holds 0"
            )
