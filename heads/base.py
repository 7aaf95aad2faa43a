"""The Head protocol: what a model outputs and how raw outputs become per-token or
per-sequence results, and the checks that hold every head to it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
    #: ``vocab`` only: the backend does not apply the output layer; it hands the head the final
    #: hidden states and the output weight (:class:`FusedOutputHead`), so that the head can
    #: compute its results without materialising the ``[tokens, vocab]`` logits.
    fused: bool = False

    def __attrs_post_init__(self) -> None:
        if self.fused and self.kind != "vocab":
            raise ConfigError(f"a fused output layer needs kind 'vocab', got {self.kind!r}")
        if self.kind == "replicated" and self.features <= 0:
            raise ConfigError(f"a replicated output layer needs features > 0, got {self.features}")
        if self.kind == "replicated" and self.allow_tied_embeddings:
            raise ConfigError("a replicated output layer cannot be tied to the embedding")


@attrs.frozen(kw_only=True)
class SequenceSplit:
    """The raw output holds only this rank's part of each row (context parallelism, Ulysses):
    ``positions`` ``[n]`` gives, for each of its ``n`` positions, the position in the caller's
    layout it stands for (a position of the backend's padding: any valid one, its value is
    dropped); ``gather`` takes per-position values ``[rows, n, *features]`` of every rank of
    the group to the caller's layout ``[rows, seq, *features]`` (collective; its backward
    sums the ranks' gradients, so a loss every rank computes alike is divided by the group's
    size before it goes backward)."""

    positions: torch.Tensor
    gather: Callable[[torch.Tensor], torch.Tensor]


@attrs.frozen(kw_only=True)
class HeadContext:
    """What the backend tells a head about the layout of the raw output it hands over."""

    #: Tensor-parallel group when the raw output is split over the vocabulary, else None.
    tensor_parallel_group: torch.distributed.ProcessGroup | None = None
    #: First vocabulary index held by this rank's shard of the logits.
    vocab_start: int = 0
    #: Real tokens of each sequence of the micro-batch; set by the engine.
    sequence_lengths: torch.Tensor | None = None
    #: Packed micro-batches: the raw output is one row holding the sequences back to back, and
    #: these are their offsets in it (``[n + 1]``, from 0 to the row's length); set by the
    #: engine. None: one sequence per row, right-padded.
    cu_seqlens: torch.Tensor | None = None
    #: Fused heads (``OutputSpec.fused``): the output layer's weight ``[V_local, hidden]``
    #: (this rank's vocabulary shard, the embedding's when tied), live and differentiable where
    #: the head runs; the raw output is then the final hidden states ``[rows, seq, hidden]``.
    #: Under tensor parallelism the hidden states' gradient is summed over the group by the
    #: backend, as for the column-parallel layer's input. None: the raw output is the layer's.
    output_weight: torch.Tensor | None = None
    #: Where a head leaves a check on the device instead of reading it now (which on an
    #: accelerator waits for the device): ``(violated, message)`` pairs, ``violated`` a
    #: one-element bool tensor; the engine raises ``ConfigError(message)`` for a set one at the
    #: end of the step, before the optimizer step. None: check at once. Set by the engine.
    deferred_checks: list[tuple[torch.Tensor, str]] | None = attrs.field(default=None, eq=False)
    #: The raw output is this rank's part of each row (:class:`SequenceSplit`); set by the
    #: backend, read by :func:`apply_head` (never by a head). None: whole rows.
    sequence_split: SequenceSplit | None = attrs.field(default=None, eq=False)


#: A result's layout: per token, aligned to the token it scores (``[batch, seq, *features]``),
#: or per sequence (``[batch, *features]``), taken at each sequence's own last token.
Granularity = Literal["token", "sequence"]
PER_TOKEN: Granularity = "token"
PER_SEQUENCE: Granularity = "sequence"


@attrs.frozen(kw_only=True)
class ResultSpec:
    """One declared result: its granularity and the trailing ``features`` dims of each entry
    (``()``: one value per token or sequence). A plain ``PER_TOKEN`` / ``PER_SEQUENCE`` in
    ``Head.outputs`` means ``features=()``."""

    granularity: Granularity
    features: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.granularity not in (PER_TOKEN, PER_SEQUENCE):
            raise ConfigError(
                f"a result's granularity must be {PER_TOKEN!r} or {PER_SEQUENCE!r}, got "
                f"{self.granularity!r}"
            )
        if not isinstance(self.features, tuple) or not all(
            isinstance(size, int) and not isinstance(size, bool) and size > 0
            for size in self.features
        ):
            raise ConfigError(
                f"a result's features must be a tuple of ints > 0 (its trailing dims), got "
                f"{self.features!r}"
            )


def per_token(*features: int) -> ResultSpec:
    """A per-token result ``[batch, seq, *features]`` (``per_token(3)``: 3 values per token)."""
    return ResultSpec(granularity=PER_TOKEN, features=features)


def per_sequence(*features: int) -> ResultSpec:
    """A per-sequence result ``[num_sequences, *features]``."""
    return ResultSpec(granularity=PER_SEQUENCE, features=features)


def declared_results(head: Head) -> dict[str, ResultSpec]:
    """``head.outputs`` with every declaration as a :class:`ResultSpec`; ConfigError naming the
    head and the key for a declaration that is neither a granularity nor a ResultSpec."""
    declared: dict[str, ResultSpec] = {}
    for key, value in head.outputs.items():
        if isinstance(value, ResultSpec):
            declared[key] = value
        elif value in (PER_TOKEN, PER_SEQUENCE):
            declared[key] = ResultSpec(granularity=value)
        else:
            raise ConfigError(
                f"head {head.name!r}: output {key!r} is declared as {value!r}; declare "
                f"{PER_TOKEN!r}, {PER_SEQUENCE!r} or a ResultSpec (heads.per_token(*features), "
                "heads.per_sequence(*features))"
            )
    return declared


@runtime_checkable
class Head(Protocol):
    """A model head. Built-ins: ``heads.lm.LMHead``, ``heads.value.ValueHead`` and
    ``heads.reward.RewardHead``.

    ``postprocess`` receives the raw output ``[rows, seq, features]`` of the layer built from
    ``output_spec()`` and the token ids ``[rows, seq]`` in one of two layouts, described by
    ``ctx``: one sequence per row, right-padded (real lengths in ``ctx.sequence_lengths``), or
    packed, one row holding every sequence back to back (offsets in ``ctx.cu_seqlens``). It
    returns each result it declares in ``outputs``:

    * per token, ``[rows, seq, *features]``, aligned with the token it scores: entry ``t`` comes
      from the hidden state at ``t - 1`` and each sequence's first entry is 0, so nothing
      carries across a sequence boundary (:func:`shift_to_scored_token` with ``ctx``);
    * per sequence, ``[num_sequences, *features]``, taken at each sequence's own last token
      (:func:`at_last_token`).

    ``features`` are the trailing dims the head declares (:class:`ResultSpec`; none for a
    plain ``PER_TOKEN`` / ``PER_SEQUENCE``).

    Using these two helpers with ``ctx`` makes a head work in both layouts.

    A head over the vocabulary may instead apply the output layer itself, so that the logits
    never exist: its ``output_spec()`` says ``fused=True`` and it implements
    ``postprocess_hidden`` (:class:`FusedOutputHead`), which receives the final hidden states and
    the output weight.

    The engine checks every micro-batch's results against the declaration
    (:func:`check_results`).
    """

    name: ClassVar[str]

    @property
    def outputs(self) -> Mapping[str, Granularity | ResultSpec]:
        """Each result's name and whether it is per token or per sequence (a
        :class:`ResultSpec` also gives its trailing feature dims)."""
        ...

    def output_spec(self) -> OutputSpec: ...

    def postprocess(
        self, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class FusedOutputHead(Head, Protocol):
    """A head whose ``output_spec()`` is ``fused``: it applies the vocabulary output layer itself
    (``postprocess`` stays for backends and callers that hand it logits)."""

    def postprocess_hidden(
        self, hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        """``postprocess``'s results from the final hidden states ``[rows, seq, hidden]`` and the
        output weight ``[V_local, hidden]`` instead of the logits."""
        ...


LossOf = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]
"""The micro-batch's loss as a function of the head's results (``postprocess``'s layout)."""


@runtime_checkable
class GradientInForwardHead(FusedOutputHead, Protocol):
    """A fused head that can compute the loss's gradient during its forward pass, where the
    loss is token-separable (its gradient at a token depends on that token's results only,
    ``engine.losses.token_separable``), so that its backward needs no recomputation."""

    def postprocess_hidden_with_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        input_ids: torch.Tensor,
        ctx: HeadContext,
        loss_of: LossOf,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """``postprocess_hidden``'s results and an *anchor*: a zero-valued scalar whose
        backward delivers the gradient of ``loss_of(results)`` to ``hidden`` and ``weight``;
        the results are then detached. ``loss_of`` may be called any number of times with
        results that hold the real values only at some tokens (placeholders elsewhere); only
        its gradient at the real tokens is used. Anchor None: the results are live and carry
        their own gradient (e.g. where the head does not take this path)."""
        ...


@runtime_checkable
class PositionwiseHead(Head, Protocol):
    """A head whose results are computed position by position: each position's values from the
    raw output at that position and the next token there alone, then placed
    (:func:`shift_to_scored_token`, :func:`at_last_token`), so that
    ``postprocess(raw, ids, ctx) == place(per_position(raw, roll(ids, -1), ctx), ctx)``. Where
    a sequence is split over ranks (:class:`SequenceSplit`), such a head runs on each rank's own
    positions and only its per-position values are gathered (one number per token and result);
    any other head gets the whole rows' raw output gathered."""

    def per_position(
        self, raw: torch.Tensor, next_tokens: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        """Each result's values ``[rows, n, *features]`` at each of the ``n`` positions of
        ``raw`` (the final hidden states where ``ctx.output_weight`` is set), ``next_tokens``
        ``[rows, n]`` the token after each position (a placeholder after a sequence's last)."""
        ...

    def place(
        self, per_position: Mapping[str, torch.Tensor], ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        """The results, from whole rows of per-position values, as ``postprocess`` returns
        them."""
        ...


def next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """The token after each position ``[rows, seq]`` (the last position's is a placeholder)."""
    return torch.roll(input_ids, shifts=-1, dims=1)


def check_fused(head: Head) -> None:
    """A head asking for a fused output layer implements ``postprocess_hidden`` (ConfigError)."""
    if head.output_spec().fused and not isinstance(head, FusedOutputHead):
        raise ConfigError(
            f"head {head.name!r} asks for a fused output layer (OutputSpec.fused) but has no "
            "postprocess_hidden(hidden, weight, input_ids, ctx)"
        )


def apply_head(
    head: Head, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
) -> dict[str, torch.Tensor]:
    """The head's results: from the hidden states and output weight where the backend handed
    them over (``ctx.output_weight``), else from the raw output of the layer. Where the raw
    output is this rank's part of each row (``ctx.sequence_split``), a
    :class:`PositionwiseHead` runs on that part and its per-position values are gathered; any
    other head's raw output is gathered first."""
    split = ctx.sequence_split
    if split is not None:
        ctx = attrs.evolve(ctx, sequence_split=None)
        if isinstance(head, PositionwiseHead):
            ahead = next_tokens(input_ids).index_select(1, split.positions)
            local = head.per_position(raw, ahead, ctx)
            return head.place({name: split.gather(v) for name, v in local.items()}, ctx)
        raw = split.gather(raw)
    if ctx.output_weight is None:
        return head.postprocess(raw, input_ids, ctx)
    if not isinstance(head, FusedOutputHead):
        raise ConfigError(
            f"the backend handed head {head.name!r} hidden states and the output weight, but "
            "the head has no postprocess_hidden(hidden, weight, input_ids, ctx)"
        )
    return head.postprocess_hidden(raw, ctx.output_weight, input_ids, ctx)


def apply_head_with_loss(
    head: Head, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext, loss_of: LossOf
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """:func:`apply_head` for a training step whose loss is token-separable: a
    :class:`GradientInForwardHead` handed the hidden states gives detached results and the
    anchor carrying the loss's gradient; any other head live results and None."""
    split = ctx.sequence_split is not None  # there the head runs on part of each row
    if ctx.output_weight is not None and isinstance(head, GradientInForwardHead) and not split:
        return head.postprocess_hidden_with_loss(raw, ctx.output_weight, input_ids, ctx, loss_of)
    return apply_head(head, raw, input_ids, ctx), None


def shift_to_scored_token(
    per_position: torch.Tensor, ctx: HeadContext | None = None
) -> torch.Tensor:
    """Move results ``[rows, seq, *features]`` computed at position ``t - 1`` to the token
    ``t`` they score; each sequence's first entry is 0 (every row's entry 0, and in a packed
    row every sequence start ``ctx.cu_seqlens[:-1]``), so nothing carries across a sequence
    boundary."""
    shifted = torch.zeros_like(per_position)
    shifted[:, 1:] = per_position[:, :-1]
    if ctx is not None and ctx.cu_seqlens is not None:
        starts = ctx.cu_seqlens[:-1].to(
            device=per_position.device, dtype=torch.long, non_blocking=True
        )
        shifted = shifted.index_fill(1, starts, 0)
    return shifted


def at_last_token(per_position: torch.Tensor, ctx: HeadContext) -> torch.Tensor:
    """Each sequence's value at its own last token, ``[num_sequences, *features]``: from a
    packed row (``ctx.cu_seqlens``) or from right-padded rows ``[batch, seq, *features]``."""
    if ctx.cu_seqlens is not None:
        ends = ctx.cu_seqlens[1:].to(per_position.device, torch.long, non_blocking=True) - 1
        return per_position[0, ends]
    rows = torch.arange(per_position.shape[0], device=per_position.device)
    if ctx.sequence_lengths is None:
        return per_position[:, -1]
    last = ctx.sequence_lengths.to(per_position.device, torch.long, non_blocking=True) - 1
    return per_position[rows, last]


def check_results(
    head: Head,
    results: Mapping[str, torch.Tensor],
    input_ids: torch.Tensor,
    ctx: HeadContext | None = None,
    *,
    deferred: list[tuple[torch.Tensor, str]] | None = None,
) -> None:
    """The results are what ``head.outputs`` declares: the same keys, ``[rows, seq,
    *features]`` per-token results with nothing at any sequence's first position (the shift to
    the scored token), ``[num_sequences, *features]`` per-sequence ones. ConfigError naming the
    head and the key otherwise.

    The first-position check reads values, which on an accelerator waits for the device; with
    ``deferred`` it appends ``(violated, message)`` (a one-element bool tensor) there instead,
    for the caller to check with the step's other numbers and raise ConfigError(message)."""
    declared = declared_results(head)
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
    packed = ctx.cu_seqlens if ctx is not None else None
    sequences = batch if packed is None else len(packed) - 1
    starts = packed[:-1].long() if packed is not None else None
    for key, spec in declared.items():
        value = results[key]
        granularity = spec.granularity
        leading = [batch, length] if granularity == PER_TOKEN else [sequences]
        expected = [*leading, *spec.features]
        if not isinstance(value, torch.Tensor) or list(value.shape) != expected:
            found = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            features = f" with features {list(spec.features)}" if spec.features else ""
            raise ConfigError(
                f"{where}: output {key!r} is declared per {granularity}{features}, so it must "
                f"have shape {expected} for input_ids {[batch, length]}; got {found}"
                + _shape_hint(value, leading, [batch, length], spec)
            )
        if granularity != PER_TOKEN:
            continue
        firsts = (
            value[:, 0] if starts is None else value[0, starts.to(value.device, non_blocking=True)]
        )
        place = "position 0" if starts is None else "a sequence's first position"
        message = (
            f"{where}: per-token output {key!r} has a value at {place}; entry t must score "
            "token t from the hidden state at t - 1 and each sequence's first entry is 0 "
            "(use heads.base.shift_to_scored_token(values, ctx), which also keeps packed "
            "sequences apart)"
        )
        violated = firsts.detach().ne(0).any()
        if deferred is not None:
            deferred.append((violated, message))
        elif bool(violated):
            raise ConfigError(message)


def _shape_hint(value: object, leading: list[int], token: list[int], spec: ResultSpec) -> str:
    """What to change when the leading dims are right but the trailing ones are not (declare
    them), or when a per-sequence result is laid out per token (``token``: ``[rows, seq]``)."""
    if not isinstance(value, torch.Tensor):
        return ""
    shape = list(value.shape)
    if spec.granularity == PER_SEQUENCE and shape == [*token, *spec.features]:
        return " (one entry per token: take each sequence's last one with heads.at_last_token)"
    if shape[: len(leading)] != leading:
        return ""
    trailing = shape[len(leading) :]
    make = "per_token" if spec.granularity == PER_TOKEN else "per_sequence"
    return (
        f" (trailing dims {trailing} where {list(spec.features)} are declared: declare "
        f"heads.{make}({', '.join(map(str, trailing))}) in outputs, or return those)"
    )
