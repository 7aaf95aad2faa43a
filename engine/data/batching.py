"""Batches: jagged <-> padded conversion, validation, row selection, micro-batches, output restore.

A batch is a ``tensordict.TensorDict`` with batch size ``[num_sequences]``. Per-token fields are
jagged (``torch.nested`` jagged layout) or padded ``[B, L]`` with a boolean/0-1
``attention_mask`` (left or right padding); per-sequence fields have shape ``[B]``.
Internally every micro-batch is right-padded to its own longest sequence; loss functions see it
that way (fields ``[b, s]`` plus ``attention_mask``), and per-token outputs come back jagged, in
the input order.
"""

from __future__ import annotations

import difflib
import importlib
import itertools
import logging
import numbers
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, TypeAlias, TypeGuard

import attrs
import numpy
import torch
from tensordict import NestedKey, NonTensorData, NonTensorStack, TensorDict

from heads.errors import BatchError, ConfigError


def _not_the_fx_tracing_notice(record: logging.LogRecord) -> bool:
    """torch logs an ``is_fx_tracing`` deprecation notice the first time a jagged tensor is
    built from buffers (``nested_tensor_from_jagged``); nothing a user of this engine can act
    on, so that one message is dropped."""
    return "is_fx_tracing will return true" not in record.getMessage()


logging.getLogger("torch.fx._symbolic_trace").addFilter(_not_the_fx_tracing_notice)

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
#: Router replay's field: the experts each token is routed to, per MoE layer.
ROUTED_EXPERTS = "routed_experts"
#: Hugging Face's training targets: the token ids, ``IGNORE_INDEX`` where a token is not trained.
LABELS = "labels"
IGNORE_INDEX = -100
#: The per-token field the losses train on (``engine.losses.LOSS_MASK``).
LOSS_MASK = "loss_mask"


def jagged(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """A jagged nested tensor from 1-D rows."""
    return torch.nested.nested_tensor(list(rows), layout=torch.jagged)


def from_token_lists(
    token_lists: Sequence[Sequence[int]], **fields: Sequence[Sequence[float]] | Sequence[float]
) -> TensorDict:
    """A jagged batch from lists of token ids and more fields, one entry per sequence: a list
    of the sequence's length is a per-token field (float32), a number a per-sequence one
    (``[B]``: int64 for integers, e.g. ``group_ids``, else float32)."""
    if not token_lists:
        raise BatchError("a batch needs at least one sequence")
    ids = [_token_ids(index, tokens) for index, tokens in enumerate(token_lists)]
    columns: dict[str, torch.Tensor] = {INPUT_IDS: jagged(ids)}
    for name, rows in fields.items():
        if len(rows) != len(ids):
            raise BatchError(
                f"field {name!r} has {len(rows)} entries for {len(ids)} sequences (one each)"
            )
        scalars = [isinstance(row, numbers.Number) for row in rows]
        if all(scalars):
            per_sequence = torch.as_tensor(list(rows))
            if per_sequence.dtype.is_floating_point:
                per_sequence = per_sequence.to(torch.float32)
            columns[name] = per_sequence
            continue
        if any(scalars):
            raise BatchError(
                f"field {name!r} mixes numbers (per sequence) and lists (per token); give one "
                "kind for every sequence"
            )
        values = [torch.as_tensor(row, dtype=torch.float32) for row in rows]
        wrong = [
            i for i, (v, row) in enumerate(zip(values, ids, strict=True)) if len(v) != len(row)
        ]
        if wrong:
            index = wrong[0]
            raise BatchError(
                f"per-token field {name!r} must have the lengths of input_ids; sequence {index} "
                f"has {len(ids[index])} tokens and {len(values[index])} values"
            )
        columns[name] = jagged(values)
    return TensorDict(columns, batch_size=[len(ids)])


def _token_ids(index: int, tokens: Sequence[int]) -> torch.Tensor:
    """One row of token ids as int64; floats and bools are refused (a cast would truncate)."""
    row = torch.as_tensor(tokens)
    if row.numel() and (row.dtype.is_floating_point or row.is_complex() or row.dtype == torch.bool):
        raise BatchError(
            f"sequence {index}: token ids must be integers, got {row.dtype} values ({_show(row)})"
        )
    return row.to(torch.long)


def _nested_module() -> ModuleType | None:
    """torch's module of its jagged tensor class; it is private, so None (and the slower public
    calls) if a torch version moves it."""
    try:
        return importlib.import_module("torch.nested._internal.nested_tensor")
    except ImportError:  # pragma: no cover - depends on the torch version
        return None


def _jagged_class() -> type | None:
    """torch's jagged tensor class (None: see :func:`_nested_module`)."""
    found = getattr(_NESTED_MODULE, "NestedTensor", None)
    return found if isinstance(found, type) else None


_NESTED_MODULE = _nested_module()
_JaggedClass = _jagged_class()


def is_jagged(value: torch.Tensor) -> bool:
    """Whether ``value`` is a jagged nested tensor (``is_nested`` asks torch's Python dispatch,
    ~30 us a call on a jagged tensor; the engine asks several times a step)."""
    if _JaggedClass is None:  # pragma: no cover - depends on the torch version
        return bool(value.is_nested and value.layout == torch.jagged)
    return isinstance(value, _JaggedClass)


def jagged_values(values: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor's buffer ``[N, ...]`` (all rows' tokens), as torch stores it:
    ``values()`` goes through torch's Python dispatch (~60 us a call), this is an attribute
    read (as ``offsets()`` is)."""
    buffer = getattr(values, "_values", None)
    return buffer if isinstance(buffer, torch.Tensor) else values.values()


def jagged_offsets(values: torch.Tensor) -> torch.Tensor:
    """Row offsets ``[B + 1]`` of a jagged nested tensor."""
    offsets: torch.Tensor = values.offsets()  # type: ignore[attr-defined]
    return offsets


def jagged_lengths(values: torch.Tensor) -> torch.Tensor:
    """Row lengths of a jagged nested tensor."""
    return jagged_offsets(values).diff()


def sequence_lengths(batch: TensorDict) -> torch.Tensor:
    """Number of real tokens of each sequence."""
    ids = _field(batch, INPUT_IDS)
    if is_jagged(ids):
        return jagged_lengths(ids)
    if ATTENTION_MASK in batch.keys():
        return _field(batch, ATTENTION_MASK).bool().sum(-1)
    return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long)


def to_jagged(batch: TensorDict) -> TensorDict:
    """Padded (left or right) + ``attention_mask`` -> jagged; per-sequence fields kept."""
    ids = _field(batch, INPUT_IDS)
    if is_jagged(ids):
        return batch
    mask = _padding_mask(batch)
    columns: dict[str, torch.Tensor] = {}
    for name, value in fields(batch):
        if name == ATTENTION_MASK:
            continue
        if _is_per_token(value, ids):
            columns[name] = jagged([row[keep] for row, keep in zip(value, mask, strict=True)])
        else:
            columns[name] = value
    return TensorDict(columns, batch_size=batch.batch_size)


def to_padded(batch: TensorDict, *, side: str = "right", pad_id: int = 0) -> TensorDict:
    """Jagged -> padded ``[B, L]`` with ``attention_mask`` (bool), padding on ``side``."""
    if side not in ("left", "right"):
        raise BatchError(f"padding side must be 'left' or 'right', got {side!r}")
    ids = _field(batch, INPUT_IDS)
    if not is_jagged(ids):
        return batch
    width = int(jagged_lengths(ids).max())
    padded, real = _padded_fields(batch, width, side, pad_id)
    columns = {name: padded.get(name, value) for name, value in fields(batch)}
    columns[ATTENTION_MASK] = real
    return TensorDict(columns, batch_size=batch.batch_size)


@attrs.frozen(kw_only=True)
class MicroBatch:
    """Sequences ``indices`` of the batch, right-padded to their own longest length; when
    packed, the model also gets them back to back in one row (``packed_ids``, ``cu_seqlens``).
    """

    indices: torch.Tensor
    #: Real tokens of each sequence, ``[b]`` (the batch's lengths, taken once per step).
    lengths: torch.Tensor
    #: ``input_ids``, ``attention_mask`` and every other field, right-padded ``[b, s]``: what
    #: loss functions see, whatever the model's layout.
    data: TensorDict
    #: Packed: the sequences' tokens back to back, ``[1, T]`` (T: their real tokens).
    packed_ids: torch.Tensor | None = None
    #: Packed: each sequence's offset in ``packed_ids``, ``[b + 1]``, from 0 to T.
    cu_seqlens: torch.Tensor | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        """The model's input: the packed row ``[1, T]``, or the right-padded rows ``[b, s]``."""
        if self.packed_ids is not None:
            return self.packed_ids
        return self.data[INPUT_IDS]

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.data[ATTENTION_MASK]

    @property
    def routed_experts(self) -> torch.Tensor | None:
        """Router replay: the experts to route each token to, ``[b, s, moe_layers, top_k]``."""
        return self.data.get(ROUTED_EXPERTS) if ROUTED_EXPERTS in self.data.keys() else None

    def unpack(self, row: torch.Tensor) -> torch.Tensor:
        """A packed per-token result ``[1, T, ...]`` -> right-padded ``[b, s, ...]`` (0 in the
        padding), differentiably; the layout loss functions see."""
        if self.cu_seqlens is None:
            raise BatchError("unpack() needs a packed micro-batch")
        # worked out on the host, where cu_seqlens lives: no device sync
        index, padding = _gather_index(self.cu_seqlens, int(self.attention_mask.shape[1]), "right")
        gathered = row[0, index.to(row.device, non_blocking=True)]
        padding = padding.reshape(*padding.shape, *[1] * (gathered.dim() - 2))
        return gathered.masked_fill(padding.to(row.device, non_blocking=True), 0)

    def right_padded(
        self, results: Mapping[str, torch.Tensor], per_token: Iterable[str]
    ) -> dict[str, torch.Tensor]:
        """The head's ``results`` as loss functions see them: the ``per_token`` ones of a packed
        micro-batch unpacked to right-padded ``[b, s, ...]``."""
        if self.cu_seqlens is None:
            return dict(results)
        keys = set(per_token)
        return {key: self.unpack(value) if key in keys else value for key, value in results.items()}


def validate_batch(batch: object, required: Iterable[str] = (), **checks: Any) -> TensorDict:
    """The batch, checked as :func:`validated` checks it (``checks``: its keyword options)."""
    return validated(batch, required, **checks)[0]


def validated(
    batch: object,
    required: Iterable[str] = (),
    *,
    granularity: Mapping[str, str] | None = None,
    vocab_size: int | None = None,
    max_length: int | None = None,
    length_limits: Iterable[tuple[int, str]] = (),
    pad_token_id: int | None = None,
    row_names: Sequence[str] | None = None,
) -> tuple[TensorDict, torch.Tensor]:
    """The batch and its sequence lengths; a malformed batch refused before any compute (a
    BatchError names the field, row and value).

    Checked (vectorised, once per batch): a TensorDict of batch size ``[B > 0]`` with integer
    ``input_ids``, jagged or padded ``[B, L]``; every field in the layout of ``input_ids``
    (per-token fields jagged with the same row lengths, or padded ``[B, L, ...]``; per-sequence
    fields one value per row, ``[B]``); a padded ``attention_mask`` shaped like ``input_ids``
    whose ones are contiguous in each row (left or right padding, no holes); every ``*mask``
    field 0 or 1 at each real token; the ``required`` fields present, each named in
    ``granularity`` per token (``"token"``) or per sequence (``"sequence"``) as it says; no
    empty sequence; token
    ids in ``[0, vocab_size)``; no sequence longer than ``max_length`` or than any of
    ``length_limits`` (``(limit, who sets it)`` pairs, named in the message); a padded batch without
    ``attention_mask`` whose row starts with ``pad_token_id`` (left padding the engine would
    take for tokens) refused, saying to give the mask. Non-finite values are
    not refused here: a loss masks out the tokens it does not score, and a non-finite loss or
    gradient never reaches the weights (the engine's non-finite guard).

    ``row_names`` (one per row, e.g. ``"data.jsonl:12"``) replace "row r" / "sequence r" in
    the messages of the per-row value checks (vocabulary, masks, lengths).
    """
    batch, ids = _checked_input_ids(batch)
    if row_names is not None and len(row_names) != ids.size(0):
        raise ConfigError(f"{len(row_names)} row_names for a batch of {ids.size(0)} rows")
    name_row = _row_namer(row_names)
    _check_required(batch, required)
    real = _real_tokens(batch, ids)
    unmasked = not is_jagged(ids) and ATTENTION_MASK not in batch.keys()
    if unmasked and pad_token_id is not None and bool((ids[:, 0] == pad_token_id).any()):
        rows = (ids[:, 0] == pad_token_id).nonzero().flatten().tolist()
        raise BatchError(
            f"padded 'input_ids' row(s) {rows[:5]} start with the model's pad token id "
            f"{pad_token_id}, and the batch has no 'attention_mask': the pads would be read as "
            "tokens. Give attention_mask (1 for real tokens, 0 for pads), or jagged rows "
            "(engine.data.batching.jagged / from_token_lists); a real token of that id at the "
            "start needs an attention_mask of ones"
        )
    for name, value in fields(batch):
        if name != INPUT_IDS:
            _check_layout(name, value, ids)
        if name.endswith("mask"):
            _check_binary(name, value, real if name != ATTENTION_MASK else None, name_row)
    for name, wanted in (granularity or {}).items():
        if name in batch.keys():
            _check_granularity(name, _field(batch, name), wanted, ids)
    lengths = sequence_lengths(batch)
    limits = [(max_length, "max_length")] if max_length is not None else []
    _check_lengths(lengths, [*limits, *length_limits], name_row)
    if vocab_size is not None:
        _check_vocabulary(ids, real, vocab_size, name_row)
    return batch, lengths


def _row_namer(names: Sequence[str] | None) -> Callable[[int], str]:
    """How a message names row ``r`` of a batch: ``names[r]``, else ``"row r"``."""
    return _row_number if names is None else names.__getitem__


def _row_number(row: int) -> str:
    return f"row {row}"


def _checked_input_ids(batch: object) -> tuple[TensorDict, torch.Tensor]:
    """The batch, a TensorDict of batch size ``[B > 0]`` holding tensors only, and its integer
    ``input_ids`` ``[B, L]``, jagged or padded."""
    if not isinstance(batch, TensorDict):
        raise BatchError(
            f"a batch must be a tensordict.TensorDict, got {type(batch).__name__}; build one with "
            "engine.data.batching.from_token_lists(...) or TensorDict({...}, batch_size=[B])"
        )
    if batch.batch_dims != 1 or batch.batch_size[0] == 0:
        raise BatchError(
            f"a batch needs batch_size [num_sequences > 0], got {list(batch.batch_size)}"
        )
    if INPUT_IDS not in batch.keys():
        raise BatchError(f"the batch has no 'input_ids'; it has: {', '.join(field_names(batch))}")
    for name in field_names(batch):
        if not isinstance(batch.get(name), torch.Tensor):
            raise BatchError(
                f"field {name!r} is a {type(batch.get(name)).__name__}; a batch holds tensors only"
            )
    ids = _field(batch, INPUT_IDS)
    dtype = _buffer(ids).dtype
    if dtype not in (torch.int64, torch.int32):
        raise BatchError(f"'input_ids' must be int64 or int32 token ids, got {dtype}")
    if not is_jagged(ids) and ids.is_nested:
        raise BatchError("jagged 'input_ids' must use torch.jagged layout (see jagged(rows))")
    if ids.dim() != 2:
        shape = f"{ids.dim()} jagged dims" if ids.is_nested else f"shape {list(ids.shape)}"
        raise BatchError(f"'input_ids' must be [B, L] (padded or jagged), got {shape}")
    return batch, ids


def _check_required(batch: TensorDict, required: Iterable[str]) -> None:
    """The ``required`` fields are there; a missing one is named with a near miss, if any."""
    missing = [name for name in required if name not in batch.keys()]
    if missing:
        spare = [name for name in field_names(batch) if name not in required]
        misspelt = [
            f"{close[0]!r} for {name!r}"
            for name in missing
            if (close := difflib.get_close_matches(name, spare, n=1, cutoff=0.75))
        ]
        hint = f" (a misspelling: {', '.join(misspelt)}?)" if misspelt else ""
        raise BatchError(
            f"the batch lacks field(s) {', '.join(missing)} needed here{hint}; it has: "
            f"{', '.join(field_names(batch))}"
        )


def _check_lengths(
    lengths: torch.Tensor, limits: Sequence[tuple[int, str]], name_row: Callable[[int], str]
) -> None:
    """No empty sequence, and none longer than any of ``limits`` (``(limit, who sets it)``)."""
    shortest, longest = (int(bound) for bound in torch.aminmax(lengths))
    if shortest < 1:
        empty = lengths.eq(0).nonzero().flatten().tolist()
        raise BatchError(f"{', '.join(name_row(row) for row in empty[:5])}: empty sequence")
    for limit, who in limits:
        if longest > limit:
            row = int(lengths.argmax())
            raise BatchError(
                f"{name_row(row)} has {longest} tokens, more than {who} ({limit}); shorten or "
                "drop the sequence, or raise the limit"
            )


def _check_vocabulary(
    ids: torch.Tensor, real: torch.Tensor | None, vocab_size: int, name_row: Callable[[int], str]
) -> None:
    """Every real token's id in ``[0, vocab_size)`` (padding may hold any id)."""
    if _ids_within(_buffer(ids) if real is None else ids[real], vocab_size):
        return
    outside = (_buffer(ids) < 0) | (_buffer(ids) >= vocab_size)
    if real is not None:
        outside &= real
    if bool(outside.any()):
        raise BatchError(
            f"'input_ids' must lie in [0, {vocab_size}) (the model's vocab_size); "
            f"{_locate(ids, outside, name_row)}"
        )


def labels_as_loss_mask(batch: TensorDict) -> TensorDict:
    """A jagged batch with Hugging Face ``labels`` and no ``loss_mask``: ``loss_mask = labels !=
    -100`` added, so that a batch made for transformers' ``model(input_ids, labels=...)`` trains
    the tokens its labels train. The engine scores each token as itself (``log_probs[t] = log
    p(x_t | x_<t)``, ``labels`` unshifted as transformers takes them), so labels that differ
    from ``input_ids`` where they are not -100 are refused, as is a batch with both fields."""
    if LABELS not in batch.keys():
        return batch
    if LOSS_MASK in batch.keys():
        raise BatchError(
            f"the batch has both {LABELS!r} and {LOSS_MASK!r}; give one (labels: the token ids "
            "with -100 where a token is not trained, read as the loss mask)"
        )
    labels, ids = _field(batch, LABELS), _field(batch, INPUT_IDS)
    if not is_jagged(labels) or labels.dtype.is_floating_point:
        raise BatchError(f"{LABELS!r} must be integer token ids per token, like input_ids")
    trained = _buffer(labels) != IGNORE_INDEX
    differs = trained & (_buffer(labels) != _buffer(ids))
    if bool(differs.any()):
        raise BatchError(
            f"{LABELS!r} differ from 'input_ids' where they are not -100 "
            f"({_locate(labels, differs)}); the engine trains each token on its own id: labels "
            "must be input_ids with -100 at the tokens not trained (unshifted, as transformers "
            "takes them)"
        )
    mask = torch.nested.nested_tensor_from_jagged(trained.to(torch.float32), jagged_offsets(ids))
    result = batch.exclude(LABELS)
    result[LOSS_MASK] = mask
    return result


def _ids_within(tokens: torch.Tensor, vocab_size: int) -> bool:
    """Whether every token id lies in ``[0, vocab_size)`` (one pass; the caller finds where not)."""
    smallest, largest = (int(bound) for bound in torch.aminmax(tokens))
    return smallest >= 0 and largest < vocab_size


def first_non_finite(batch: TensorDict) -> str | None:
    """The batch's first NaN or infinity among real tokens ("field 'returns' row 1, token 3
    holds nan"), or None: what to name when a loss comes out non-finite."""
    for name, value in fields(to_jagged(batch)):
        if value.dtype.is_floating_point:
            flat = _buffer(value)
            bad = ~torch.isfinite(flat).reshape(len(flat), -1).all(-1)
            if bool(bad.any()):
                return f"field {name!r} {_locate(value, bad)}"
    return None


def _real_tokens(batch: TensorDict, ids: torch.Tensor) -> torch.Tensor | None:
    """The padded batch's real-token mask ``[B, L]`` (checked); None for a jagged batch."""
    if ATTENTION_MASK not in batch.keys():
        return None if is_jagged(ids) else torch.ones(ids.shape, dtype=torch.bool)
    mask = _field(batch, ATTENTION_MASK)
    if is_jagged(ids):
        padding = _buffer(mask) == 0
        if bool(padding.any()):
            raise BatchError(
                f"a jagged batch has no padding, but 'attention_mask' {_locate(mask, padding)}; "
                "drop those tokens (or the attention_mask field)"
            )
        return None
    if mask.is_nested or mask.shape != ids.shape:
        raise BatchError(
            f"'attention_mask' shape {list(mask.shape)} differs from 'input_ids' {list(ids.shape)}"
        )
    _check_binary(ATTENTION_MASK, mask, None)
    real = mask.bool()
    # One run of ones per row: at most two edges between 0 and 1, counting both ends as 0.
    edges = (real[:, 1:] != real[:, :-1]).sum(-1) + real[:, 0].long() + real[:, -1].long()
    holes = (edges > 2).nonzero().flatten()
    if len(holes):
        row = int(holes[0])
        raise BatchError(
            f"'attention_mask' row {row} has a hole ({_show(real[row].long())}): its ones must "
            "be contiguous (left or right padding only); put each sequence in its own row"
        )
    return real


def _check_layout(name: str, value: torch.Tensor, ids: torch.Tensor) -> None:
    """Per-token fields in the layout of ``input_ids``; per-sequence ones a value per row."""
    jagged = is_jagged(value)
    if jagged or value.is_nested:  # is_nested is cheap on all but jagged tensors
        if not is_jagged(ids):
            raise BatchError(
                f"field {name!r} is jagged but 'input_ids' is padded: give every per-token "
                "field in the layout of 'input_ids' (to_jagged / to_padded convert a batch)"
            )
        if not jagged:
            raise BatchError(f"jagged field {name!r} must use torch.jagged layout")
        if torch.equal(jagged_offsets(value), jagged_offsets(ids)):
            return  # the same rows (the usual case, one comparison)
        have, want = jagged_lengths(value), jagged_lengths(ids)
        if not torch.equal(have, want):
            row = int((have != want).nonzero()[0])
            raise BatchError(
                f"per-token field {name!r} has {int(have[row])} values in row {row}, where "
                f"'input_ids' has {int(want[row])} tokens; per-token rows must match input_ids"
            )
    elif value.dim() > 1 and (is_jagged(ids) or value.shape[:2] != ids.shape):
        per_token = "jagged" if is_jagged(ids) else f"{list(ids.shape)}, padded"
        raise BatchError(
            f"field {name!r} has shape {list(value.shape)}: per-token fields are {per_token} "
            f"like 'input_ids', and per-sequence fields hold one value per row "
            f"([{ids.shape[0]}])"
        )


def _check_granularity(name: str, value: torch.Tensor, wanted: str, ids: torch.Tensor) -> None:
    """A field the loss reads per token (``"token"``) or per sequence (``"sequence"``) is laid
    out so (its layout is already checked: per token is jagged or ``[B, L, ...]``)."""
    per_token = value.is_nested or value.dim() > 1
    if wanted not in ("token", "sequence"):
        raise ConfigError(
            f"field {name!r}: granularity must be 'token' or 'sequence', got {wanted!r}"
        )
    if per_token == (wanted == "token"):
        return
    shape = "jagged" if value.is_nested else str(list(value.shape))
    if wanted == "token":
        layout = "jagged" if is_jagged(ids) else f"{list(ids.shape)}, padded"
        raise BatchError(
            f"field {name!r} is per-sequence ({shape}, one value per row) but the loss reads it "
            f"per token: give one value per token, {layout} like 'input_ids' (e.g. a sequence's "
            "advantage repeated on its response tokens)"
        )
    raise BatchError(
        f"field {name!r} is per-token ({shape}) but the loss reads it per sequence: give one "
        f"value per row, shape [{ids.size(0)}]"
    )


def _check_binary(
    name: str,
    value: torch.Tensor,
    real: torch.Tensor | None,
    name_row: Callable[[int], str] = _row_number,
) -> None:
    """A mask holds only 0 and 1 (at real tokens: padding positions are dropped anyway)."""
    flat = _buffer(value)
    if flat.dtype == torch.bool:
        return
    bad = (flat != 0) & (flat != 1)
    per_entry = 1 if is_jagged(value) or value.dim() == 1 else 2
    if bad.dim() > per_entry:  # an entry with trailing dims is bad where any of its values is
        bad = bad.reshape(*bad.shape[:per_entry], -1).any(-1)
    if real is not None and bad.dim() == 2:
        bad &= real
    if bool(bad.any()):
        hint = ""
        if bool((flat == -100).any()):
            hint = (
                "; Hugging Face-style labels mark ignored tokens with -100: pass "
                "loss_mask = (labels != -100) and the token ids as input_ids"
            )
        where = _locate(value, bad, name_row)
        raise BatchError(f"mask {name!r} must hold only 0 and 1; {where}{hint}")


def _buffer(value: torch.Tensor) -> torch.Tensor:
    """A jagged tensor's values ``[N, ...]`` (all rows' tokens), or the tensor itself."""
    return jagged_values(value) if is_jagged(value) else value


def _locate(
    value: torch.Tensor,
    bad: torch.Tensor,
    name_row: Callable[[int], str] = _row_number,
) -> str:
    """Where the first True of ``bad`` is and what ``value`` holds there ("row r, token t holds
    v", the row as ``name_row`` names it); ``bad`` runs over a jagged tensor's buffer ``[N]``, a
    padded ``[B, L]`` or rows ``[B]``."""
    first = bad.nonzero()[0].tolist()
    if is_jagged(value):
        offsets = jagged_offsets(value)
        row = int(torch.searchsorted(offsets, torch.tensor(first[0]), right=True)) - 1
        held = jagged_values(value)[first[0]]
        return f"{name_row(row)}, token {first[0] - int(offsets[row])} holds {_show(held)}"
    place = name_row(first[0]) + (f", position {first[1]}" if len(first) > 1 else "")
    return f"{place} holds {_show(value[tuple(first)])}"


def _show(values: torch.Tensor) -> str:
    """A few values for a message (``1 1 0 1`` or ``-100``)."""
    items = values.flatten()[:16].tolist()
    text = " ".join(f"{item:g}" if isinstance(item, float) else str(item) for item in items)
    return text + (" ..." if values.numel() > 16 else "")


#: Which sequences of a batch: a slice, indices, or a boolean mask ``[B]``.
Rows: TypeAlias = "slice | Sequence[int] | torch.Tensor"
#: Rows ``chosen`` of a nested tensor that :class:`RowSelector` does not gather itself.
NestedRows: TypeAlias = "Callable[[torch.Tensor, list[int]], torch.Tensor]"


def take_rows(batch: TensorDict, rows: Rows) -> TensorDict:
    """Sequences ``rows`` of ``batch`` (a slice, indices or a boolean mask), as ``batch[rows]``
    would give them on tensordict 0.15. tensordict 0.10 (verl 0.9.1's pin) indexes every field
    with ``tensor[rows]``, which torch refuses for jagged tensors along the batch dim. A slice
    of step 1 gives views; jagged fields that had equal offsets share the new ones; non-tensor
    entries come along (:class:`RowSelector`)."""
    return RowSelector(batch).take(rows)


class RowSelector:
    """Rows of one TensorDict, taken once (:func:`take_rows`) or for each micro-batch of a step
    (the verl adapter hands verl's loss its micro-batch's rows of verl's TensorDict).

    Every entry comes along: tensors, entries with the batch's dims indexed (a NonTensorStack:
    one object per row), those without kept whole. A jagged field's rows are gathered from its
    buffer by one index (a slice of step 1: a view): its offsets are read to the host once, and
    where a selection's rows lie is worked out once per distinct offsets, so fields whose
    offsets were equal share the new ones.

    ``feature_bounds``: whether jagged rows with feature dims (``[n, ...]``) record their
    length bounds, as tensordict's indexing does (verl's selection records them for rows of one
    dim only; ``to_padded_tensor`` pads to them, else to the buffer's length).
    ``other_nested``: the rows of nested tensors not gathered here (ragged in a later dim than
    their rows' first, or strided); None refuses them.
    """

    def __init__(
        self,
        batch: TensorDict,
        *,
        feature_bounds: bool = True,
        other_nested: NestedRows | None = None,
    ) -> None:
        self._batch = batch
        self._feature_bounds = feature_bounds
        self._other_nested = other_nested
        self._layouts: list[_Layout] = []
        #: Each layout's place in ``_layouts``, by its key.
        self._places: dict[tuple[tuple[int, ...], tuple[int, ...] | None], int] = {}
        #: By a jagged field's id: the field (kept, so that its id names it while this selector
        #: lives), its layout's place, its buffer, and whether its rows record their bounds.
        self._fields: dict[int, tuple[torch.Tensor, int, torch.Tensor, bool]] = {}
        #: By a NonTensorData's id and a number of rows: the entry (kept, so that its id names
        #: it) and its rows, made once.
        self._whole: dict[tuple[int, int], tuple[NonTensorData, NonTensorData]] = {}

    def take(self, rows: Rows) -> TensorDict:
        """Rows ``rows`` (a slice, indices or a boolean mask) of every entry the batch holds
        now."""
        index, chosen = _row_index(rows, self._batch.batch_size[0])
        gathers: dict[int, _Gather] = {}
        columns: dict[NestedKey, Any] = {}
        for name, value in self._batch.items():
            field = self._fields.get(id(value))
            if field is None and _gatherable(value):
                field = self._read(value)
            if field is not None:
                _, place, buffer, bounded = field
                if place not in gathers:
                    gathers[place] = self._layouts[place].gather(index, chosen)
                columns[name] = gathers[place].rows(buffer, bounded=bounded)
            elif isinstance(value, torch.Tensor) and value.is_nested:
                columns[name] = self._nested_rows(name, value, list(chosen))
            elif isinstance(value, torch.Tensor):
                columns[name] = value[index]
            elif not value.shape:  # no batch dims: one entry for the whole batch, kept
                columns[name] = value
            elif isinstance(value, NonTensorData):
                columns[name] = self._whole_rows(value, len(chosen))
            elif isinstance(value, NonTensorStack) and value.stack_dim == 0 and chosen:
                # one object per row: the chosen ones stacked (indexing works out the same
                # stack ~4x slower)
                columns[name] = NonTensorStack(
                    *(value.tensordicts[row] for row in chosen), stack_dim=0
                )
            else:
                columns[name] = value[index]
        # entries of the batch's own, checked when it was made: made without the constructor's
        # check of every entry (~140 us a selection of 18 entries)
        return TensorDict._new_unsafe(
            columns, batch_size=torch.Size([len(chosen)]), device=self._batch.device
        )

    def _whole_rows(self, value: NonTensorData, count: int) -> NonTensorData:
        """``count`` rows of ``value``, one value for every row: its first (a slice is faster),
        made once per count and shared by the selections of as many rows."""
        key = (id(value), count)
        if key not in self._whole:
            self._whole[key] = (value, value[:count])
        return self._whole[key][1]

    def _read(self, value: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor, bool]:
        """A jagged field's entry in ``_fields``: its layout read to the host (kept once for
        fields laid out alike)."""
        offsets, holes = jagged_offsets(value), getattr(value, "_lengths", None)
        starts = offsets.tolist()
        lengths = None if holes is None else holes.tolist()
        key = (tuple(starts), None if lengths is None else tuple(lengths))
        place = self._places.setdefault(key, len(self._layouts))
        if place == len(self._layouts):
            self._layouts.append(_Layout.of(offsets, starts, lengths))
        buffer = jagged_values(value)
        bounded = self._feature_bounds or buffer.dim() == 1
        self._fields[id(value)] = (value, place, buffer, bounded)
        return self._fields[id(value)]

    def _nested_rows(self, name: str, value: torch.Tensor, chosen: list[int]) -> torch.Tensor:
        if self._other_nested is None:
            raise BatchError(
                f"field {name!r}: rows are taken of jagged fields ragged in their rows' first "
                f"dim, and this one is {_nested_kind(value)}"
            )
        return self._other_nested(value, chosen)


def _gatherable(value: object) -> TypeGuard[torch.Tensor]:
    """A jagged tensor ragged in its rows' first dim: its rows lie in its buffer one after
    another (with holes, where it has ``lengths()``)."""
    return (
        isinstance(value, torch.Tensor)
        and is_jagged(value)
        and getattr(value, "_ragged_idx", 1) == 1
    )


def _nested_kind(value: torch.Tensor) -> str:
    if value.layout == torch.jagged:
        return f"ragged in dim {getattr(value, '_ragged_idx', '?')}"
    return f"a nested tensor of layout {value.layout}"


def _row_index(rows: Rows, total: int) -> tuple[slice | torch.Tensor, Sequence[int]]:
    """``rows`` as a slice of step 1 within ``[0, total)`` or as int64 indices into it, and
    the rows it names: negative indices count from the end, one out of range raises IndexError
    (as indexing does)."""
    if isinstance(rows, slice):
        start, stop, step = rows.indices(total)
        if step == 1:
            return slice(start, max(start, stop)), range(start, max(start, stop))
        index = torch.arange(total)[rows]
        return index, index.tolist()
    index = torch.as_tensor(rows)
    if index.dtype == torch.bool:
        if index.shape != (total,):
            raise BatchError(f"a row mask needs {total} entries, got shape {list(index.shape)}")
        index = index.nonzero().flatten()
        return index, index.tolist()
    if index.dim() != 1 or (index.numel() and (index.is_floating_point() or index.is_complex())):
        raise BatchError(f"rows must be a slice, 1-D integer indices or a row mask, got {rows}")
    chosen: list[int] = index.tolist()
    outside = [row for row in chosen if not -total <= row < total]
    if outside:
        raise IndexError(f"index {outside[0]} is out of bounds for dimension 0 with size {total}")
    if any(row < 0 for row in chosen):
        chosen = [row % total for row in chosen]
        return torch.tensor(chosen, dtype=torch.long, device=index.device), chosen
    return index.long(), chosen


@attrs.frozen
class _Layout:
    """A jagged field's rows, read to the host: where each starts in the buffer and how long
    it is (``holes``: the field has lengths of its own, its rows need not touch)."""

    offsets: torch.Tensor
    starts: list[int]
    lengths: list[int]
    holes: bool

    @classmethod
    def of(cls, offsets: torch.Tensor, starts: list[int], holes: list[int] | None) -> _Layout:
        """The layout of ``offsets`` (``starts``: on the host) and ``holes``' row lengths."""
        if holes is None:
            lengths = list(map(operator.sub, starts[1:], starts[:-1]))
            return cls(offsets=offsets, starts=starts, lengths=lengths, holes=False)
        return cls(offsets=offsets, starts=starts, lengths=holes, holes=True)

    def gather(self, index: slice | torch.Tensor, chosen: Sequence[int]) -> _Gather:
        """Where rows ``chosen`` (``index``, as :func:`_row_index` gives them) lie in a buffer
        laid out so, and their offsets."""
        lengths = [self.lengths[row] for row in chosen]
        bounds = (min(lengths), max(lengths)) if lengths else (None, None)
        if isinstance(index, slice) and not self.holes:  # contiguous rows: a view
            begin, end = self.starts[index.start], self.starts[index.stop]
            offsets = self.offsets[index.start : index.stop + 1] - begin
            return _Gather(offsets, slice(begin, end), *bounds)
        device = self.offsets.device
        ends = list(itertools.accumulate(lengths, initial=0))
        offsets = torch.tensor(ends, dtype=self.offsets.dtype, device=device)
        if not self.holes and _consecutive(chosen):  # one stretch of the buffer
            begin, end = self.starts[chosen[0]], self.starts[chosen[-1] + 1]
            return _Gather(offsets, torch.arange(begin, end, device=device), *bounds)
        # each selected token's place in the buffer: its row's old start + its place in the
        # row, worked out on the host (numpy: a few us, whatever the number of rows)
        moved = [self.starts[row] - end for row, end in zip(chosen, ends[:-1], strict=True)]
        where = numpy.repeat(numpy.array(moved, dtype=numpy.int64), lengths)
        where += numpy.arange(ends[-1], dtype=numpy.int64)
        return _Gather(offsets, torch.from_numpy(where).to(device), *bounds)


def _consecutive(chosen: Sequence[int]) -> bool:
    """Whether rows ``chosen`` follow one another, in order."""
    return bool(chosen) and list(chosen) == list(range(chosen[0], chosen[0] + len(chosen)))


@attrs.frozen
class _Gather:
    """Some rows of a jagged layout: their offsets, what to read of a buffer (a slice: a view;
    else the positions), and the shortest and longest row (None when no row is selected)."""

    offsets: torch.Tensor
    where: torch.Tensor | slice
    shortest: int | None
    longest: int | None

    def rows(self, buffer: torch.Tensor, *, bounded: bool) -> torch.Tensor:
        """The rows of a field with this layout (``buffer``: its values), their length bounds
        recorded where ``bounded``."""
        where = self.where
        values = buffer[where] if isinstance(where, slice) else buffer.index_select(0, where)
        if bounded and self.shortest is not None and self.longest is not None:
            return _jagged_from(values, self.offsets, self.shortest, self.longest)
        return torch.nested.nested_tensor_from_jagged(values, self.offsets)


def _jagged_from(
    values: torch.Tensor, offsets: torch.Tensor, shortest: int, longest: int
) -> torch.Tensor:
    """``nested_tensor_from_jagged(values, offsets, min_seqlen=, max_seqlen=)``; for values
    that need no gradient, made without the call's dispatch (:func:`_jagged_maker`)."""
    if _MAKE_JAGGED is not None and not values.requires_grad:
        return _MAKE_JAGGED(values, offsets, shortest, longest)
    return torch.nested.nested_tensor_from_jagged(
        values, offsets, min_seqlen=shortest, max_seqlen=longest
    )


def _jagged_maker() -> Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor] | None:
    """``nested_tensor_from_jagged(values, offsets, min_seqlen=, max_seqlen=)`` for values that
    need no gradient, made as that call's view op makes it (torch's jagged class given the
    buffer, offsets and the row lengths' bounds) but without the op's dispatch: ~40 us a tensor
    rather than ~140 us, and a selection makes one per jagged field. None (the public call)
    where a torch version moved the private parts."""
    store = getattr(_NESTED_MODULE, "_store_val_in_tensor", None)
    jagged_class = _JaggedClass
    if jagged_class is None or not callable(store):  # pragma: no cover - depends on torch
        return None

    def make(values: torch.Tensor, offsets: torch.Tensor, shortest: int, longest: int) -> Any:
        cache = {"min_seqlen": store(shortest), "max_seqlen": store(longest)}
        return jagged_class(values, offsets, _metadata_cache=cache)

    # checked once against the public call: a torch whose private parts changed meaning gets
    # the public call, not a wrong tensor
    values, offsets = torch.arange(5.0), torch.tensor([0, 2, 5])
    try:
        made = make(values, offsets, 2, 3)
        public: Any = torch.nested.nested_tensor_from_jagged(
            values, offsets, min_seqlen=2, max_seqlen=3
        )
        same = (
            type(made) is type(public)
            and made.shape == public.shape
            and torch.equal(made.values(), public.values())
            and torch.equal(made.offsets(), public.offsets())
            and (made._min_seqlen, made._max_seqlen) == (public._min_seqlen, public._max_seqlen)
            and all(torch.equal(a, b) for a, b in zip(made.unbind(), public.unbind(), strict=True))
        )
    except Exception:  # pragma: no cover - depends on the torch version
        same = False
    return make if same else None


_MAKE_JAGGED = _jagged_maker()


def jagged_view(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch.nested.nested_tensor_from_jagged(values, offsets)``, differentiable, made without
    that call's dispatch (torch's jagged class given the buffer, where :func:`_jagged_maker`
    found it to make what the call makes): ~45 us rather than ~115 us for values that need
    gradients, and the backward pass ~160 us cheaper (the gradient's buffer, read as an
    attribute)."""
    if _MAKE_JAGGED is None or _JaggedClass is None:  # pragma: no cover - depends on torch
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    if values.requires_grad and torch.is_grad_enabled():
        made: torch.Tensor = _JaggedView.apply(values, offsets)
        return made
    return _JaggedClass(values, offsets)


class _JaggedView(torch.autograd.Function):
    """A jagged tensor of a buffer that needs gradients: the gradient is the jagged
    gradient's buffer (the old ``ViewNestedFromBuffer`` of torch's jagged tensors)."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        assert _JaggedClass is not None
        made: torch.Tensor = _JaggedClass(values.detach(), offsets)
        return made

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return jagged_values(grad), None


def split_fixed(batch: TensorDict, micro_batch_size: int) -> list[MicroBatch]:
    """Consecutive micro-batches of ``micro_batch_size`` sequences, each padded to its longest."""
    total = batch.batch_size[0]
    starts = range(0, total, micro_batch_size)
    return split_into(batch, [list(range(s, min(s + micro_batch_size, total))) for s in starts])


def split_into(
    batch: TensorDict,
    groups: Sequence[Sequence[int]],
    *,
    packed: bool = False,
    lengths: torch.Tensor | None = None,
) -> list[MicroBatch]:
    """One micro-batch per group of sequence indices, each right-padded to its own longest
    (``input_ids`` int64); ``packed``: each also holds its sequences back to back in one row for
    the model. ``lengths``: the batch's sequence lengths, where the caller has them."""
    rows = to_jagged(batch)
    if lengths is None:
        lengths = sequence_lengths(rows)
    sizes, longest = lengths.tolist(), int(lengths.max())
    # Every field padded once to the longest sequence; each micro-batch takes its rows of it.
    padded, real = _padded_fields(rows, longest, "right")
    # token ids as heads and models take them, whichever integer type the batch holds
    padded[INPUT_IDS] = padded[INPUT_IDS].long()
    micro_batches = []
    for group in groups:
        indices = torch.tensor(list(group), dtype=torch.long)
        width = max(sizes[i] for i in group)
        columns: dict[str, torch.Tensor] = {}
        for name, value in fields(rows):
            if name in padded:
                columns[name] = padded[name][indices, :width]
            else:
                columns[name] = value[indices]
        columns[ATTENTION_MASK] = real[indices, :width]
        data = TensorDict(columns, batch_size=[len(group)])
        packing: dict[str, torch.Tensor] = {}
        group_lengths = lengths[indices]
        if packed:  # the real tokens of the right-padded rows, row after row
            packing["packed_ids"] = columns[INPUT_IDS][columns[ATTENTION_MASK]][None]
            packing["cu_seqlens"] = torch.cat([group_lengths.new_zeros(1), group_lengths.cumsum(0)])
        micro_batches.append(
            MicroBatch(indices=indices, lengths=group_lengths, data=data, **packing)
        )
    return micro_batches


def restore_outputs(
    outputs: Sequence[dict[str, torch.Tensor]],
    micro_batches: Sequence[MicroBatch],
    total: int,
    per_sequence: Iterable[str] = (),
) -> TensorDict:
    """Per-micro-batch outputs -> one TensorDict in the original sequence order: per-token
    outputs (right-padded ``[b, s]``) come back jagged, the ``per_sequence`` ones (``[b]``) as
    one ``[total]`` tensor."""
    order = torch.cat([mb.indices for mb in micro_batches])
    if sorted(order.tolist()) != list(range(total)):
        raise BatchError("micro-batches must cover every sequence exactly once")
    keys = list(outputs[0].keys()) if outputs else []
    sequence_keys = set(per_sequence)
    columns: dict[str, torch.Tensor] = {}
    for key in keys:
        if key in sequence_keys:
            gathered = torch.cat([produced[key] for produced in outputs])
            columns[key] = torch.empty_like(gathered).index_copy_(0, order, gathered)
            continue
        rows: list[torch.Tensor] = [torch.empty(0)] * total
        for produced, mb in zip(outputs, micro_batches, strict=True):
            lengths = mb.lengths.tolist()
            for row, index, length in zip(produced[key], mb.indices.tolist(), lengths, strict=True):
                rows[index] = row[:length]
        columns[key] = jagged(rows)
    return TensorDict(columns, batch_size=[total])


def _field(batch: TensorDict, name: str) -> torch.Tensor:
    value: torch.Tensor = batch[name]
    return value


def fields(batch: TensorDict) -> Iterator[tuple[str, torch.Tensor]]:
    """The batch's (name, tensor) pairs (a batch is flat: no nested TensorDicts)."""
    for name in field_names(batch):
        yield name, _field(batch, name)


def field_names(batch: TensorDict) -> list[str]:
    return [str(name) for name in batch.keys()]


def _padding_mask(batch: TensorDict) -> torch.Tensor:
    ids = _field(batch, INPUT_IDS)
    if ATTENTION_MASK not in batch.keys():
        return torch.ones(ids.shape, dtype=torch.bool)
    mask = _field(batch, ATTENTION_MASK)
    if mask.shape != ids.shape:
        raise BatchError(
            f"'attention_mask' shape {list(mask.shape)} differs from 'input_ids' {list(ids.shape)}"
        )
    return mask.bool()


def _is_per_token(value: torch.Tensor, ids: torch.Tensor) -> bool:
    return value.dim() >= 2 and value.shape[:2] == ids.shape[:2]


def _padded_fields(
    batch: TensorDict, width: int, side: str, pad_id: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every jagged field of ``batch`` as ``[B, width, ...]``, padded on ``side`` (``input_ids``
    with ``pad_id``, the rest with 0), and the real-token mask ``[B, width]``.

    One gather per field from its buffer rather than a copy per row; where to gather is worked
    out once for all the fields laid out like ``input_ids``.
    """
    shared = jagged_offsets(_field(batch, INPUT_IDS))
    index, padding = _gather_index(shared, width, side)
    columns: dict[str, torch.Tensor] = {}
    for name, value in fields(batch):
        if not is_jagged(value):
            continue
        flat, offsets = jagged_values(value), jagged_offsets(value)
        where, skip = (
            (index, padding)
            if torch.equal(offsets, shared)
            else _gather_index(offsets, width, side)
        )
        skip = skip.reshape(*skip.shape, *[1] * (flat.dim() - 1))
        columns[name] = flat[where].masked_fill_(skip, pad_id if name == INPUT_IDS else 0)
    return columns, ~padding


def _gather_index(
    offsets: torch.Tensor, width: int, side: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a ``[B, width]`` layout of jagged rows with ``offsets``, padded on ``side``: the
    buffer position each entry reads (clamped into the buffer), and which entries are padding."""
    lengths = offsets.diff()[:, None]
    positions = torch.arange(width, device=offsets.device)
    if side == "left":
        positions = positions - (width - lengths)
        padding = positions < 0
    else:
        padding = positions >= lengths
    last = max(int(offsets[-1]) - 1, 0)
    return (offsets[:-1, None] + positions).clamp_(0, last), padding
