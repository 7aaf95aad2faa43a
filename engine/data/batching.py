"""Batches: jagged <-> padded conversion, validation, fixed-size micro-batches, output restore.

A batch is a ``tensordict.TensorDict`` with batch size ``[num_sequences]``. Per-token fields are
jagged (``torch.nested`` jagged layout) or padded ``[B, L]`` with a boolean/0-1
``attention_mask`` (left or right padding); per-sequence fields have shape ``[B, ...]``.
Internally every micro-batch is right-padded to its own longest sequence; loss functions see it
that way (fields ``[b, s]`` plus ``attention_mask``), and per-token outputs come back jagged, in
the input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import attrs
import torch
from tensordict import TensorDict

from heads.errors import BatchError

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"


def jagged(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """A jagged nested tensor from 1-D rows."""
    return torch.nested.nested_tensor(list(rows), layout=torch.jagged)


def from_token_lists(
    token_lists: Sequence[Sequence[int]], **per_token: Sequence[Sequence[float]]
) -> TensorDict:
    """A jagged batch from lists of token ids (and per-token fields of the same lengths)."""
    if not token_lists:
        raise BatchError("a batch needs at least one sequence")
    ids = [torch.as_tensor(tokens, dtype=torch.long) for tokens in token_lists]
    columns: dict[str, torch.Tensor] = {INPUT_IDS: jagged(ids)}
    for name, rows in per_token.items():
        values = [torch.as_tensor(row, dtype=torch.float32) for row in rows]
        if [len(row) for row in values] != [len(row) for row in ids]:
            raise BatchError(f"per-token field {name!r} must have the lengths of input_ids")
        columns[name] = jagged(values)
    return TensorDict(columns, batch_size=[len(ids)])


def jagged_offsets(values: torch.Tensor) -> torch.Tensor:
    """Row offsets ``[B + 1]`` of a jagged nested tensor."""
    offsets: torch.Tensor = values.offsets()  # type: ignore[attr-defined]
    return offsets


def jagged_lengths(values: torch.Tensor) -> torch.Tensor:
    """Row lengths of a jagged nested tensor."""
    return jagged_offsets(values).diff()


def jagged_rows(values: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a jagged nested tensor as views of its buffer (cheaper than indexing it)."""
    flat = values.values()
    bounds = jagged_offsets(values).tolist()
    return [flat[start:end] for start, end in itertools.pairwise(bounds)]


def sequence_lengths(batch: TensorDict) -> torch.Tensor:
    """Number of real tokens of each sequence."""
    ids = _field(batch, INPUT_IDS)
    if ids.is_nested:
        return jagged_lengths(ids)
    if ATTENTION_MASK in batch.keys():
        return _field(batch, ATTENTION_MASK).bool().sum(-1)
    return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long)


def to_jagged(batch: TensorDict) -> TensorDict:
    """Padded (left or right) + ``attention_mask`` -> jagged; per-sequence fields kept."""
    ids = _field(batch, INPUT_IDS)
    if ids.is_nested:
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
    if not ids.is_nested:
        return batch
    lengths = jagged_lengths(ids)
    columns: dict[str, torch.Tensor] = {}
    for name, value in fields(batch):
        if value.is_nested:
            fill = pad_id if name == INPUT_IDS else 0
            columns[name] = _pad_rows(jagged_rows(value), int(lengths.max()), side, fill)
        else:
            columns[name] = value
    positions = torch.arange(int(lengths.max()))
    mask = positions < lengths[:, None]
    columns[ATTENTION_MASK] = mask if side == "right" else mask.flip(-1)
    return TensorDict(columns, batch_size=batch.batch_size)


@attrs.frozen(kw_only=True)
class MicroBatch:
    """Sequences ``indices`` of the batch, right-padded to their own longest length."""

    indices: torch.Tensor
    #: ``input_ids``, ``attention_mask`` and every other field, right-padded ``[b, s]``.
    data: TensorDict

    @property
    def input_ids(self) -> torch.Tensor:
        return self.data[INPUT_IDS]

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.data[ATTENTION_MASK]

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens of each row."""
        return self.attention_mask.sum(-1)


def validate_batch(batch: object, required: Iterable[str] = ()) -> TensorDict:
    """Check the batch's type, ``input_ids`` dtype and shape, and the fields a loss needs."""
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
    ids = _field(batch, INPUT_IDS)
    if ids.dtype not in (torch.int64, torch.int32):
        raise BatchError(f"'input_ids' must be int64 or int32 token ids, got {ids.dtype}")
    if not ids.is_nested and ids.dim() != 2:
        raise BatchError(f"padded 'input_ids' must be [B, L], got shape {list(ids.shape)}")
    missing = [name for name in required if name not in batch.keys()]
    if missing:
        raise BatchError(
            f"the batch lacks field(s) {', '.join(missing)} needed here; it has: "
            f"{', '.join(field_names(batch))}"
        )
    lengths = sequence_lengths(batch)
    if bool((lengths < 1).any()):
        raise BatchError(f"sequence(s) {lengths.eq(0).nonzero().flatten().tolist()} are empty")
    return batch


def split_fixed(batch: TensorDict, micro_batch_size: int) -> list[MicroBatch]:
    """Consecutive micro-batches of ``micro_batch_size`` sequences, each padded to its longest."""
    total = batch.batch_size[0]
    starts = range(0, total, micro_batch_size)
    return split_into(batch, [list(range(s, min(s + micro_batch_size, total))) for s in starts])


def split_into(batch: TensorDict, groups: Sequence[Sequence[int]]) -> list[MicroBatch]:
    """One micro-batch per group of sequence indices, each right-padded to its own longest."""
    rows = to_jagged(batch)
    lengths = sequence_lengths(rows)
    per_row = {name: jagged_rows(value) for name, value in fields(rows) if value.is_nested}
    micro_batches = []
    for group in groups:
        indices = torch.tensor(list(group), dtype=torch.long)
        width = int(lengths[indices].max())
        columns: dict[str, torch.Tensor] = {}
        for name, value in fields(rows):
            if name in per_row:
                columns[name] = _pad_rows([per_row[name][i] for i in group], width, "right", 0)
            else:
                columns[name] = value[indices]
        columns[ATTENTION_MASK] = torch.arange(width) < lengths[indices][:, None]
        data = TensorDict(columns, batch_size=[len(group)])
        micro_batches.append(MicroBatch(indices=indices, data=data))
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


def _pad_rows(rows: Sequence[torch.Tensor], width: int, side: str, fill: float) -> torch.Tensor:
    out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), fill)
    for i, row in enumerate(rows):
        if side == "right":
            out[i, : row.shape[0]] = row
        else:
            out[i, width - row.shape[0] :] = row
    return out
