"""The Hugging Face weights as blocks of each rank's own shards: nothing is gathered.

A backend describes each local parameter as a :class:`ParamShard`: its local tensor, which rows
(and columns) of the full parameter those are, and which rows of the full parameter make up each
Hugging Face tensor. The last is found by running the backend's own full-tensor conversion
(megatron's QKV split, transformers' fused experts...) on a tensor of *row numbers*, so a shard
maps to Hugging Face coordinates exactly as the full export does, without a second table of
layouts. :func:`hf_blocks` turns the shards into :class:`HfBlock`: what this rank holds of one
Hugging Face tensor, a rectangle of its rows x columns.

Every rank yields one block per Hugging Face tensor of the *whole* model, in the same order (a
rank holding none of a tensor, e.g. another pipeline stage's, yields an empty block), so a
receiver can gather each block over the default process group. Of equal blocks held on several
ranks (data-parallel replicas, a norm on every tensor-parallel rank) the lowest rank's
``contributes``; the contributing blocks tile each tensor exactly (checked).

Rows and columns are those of the tensor's *row view*: ``(prod(shape[:-1]), shape[-1])`` for a
tensor of two or more dimensions, ``(numel, 1)`` for a vector.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import attrs
import torch
import torch.distributed as dist

from heads.errors import EngineStateError
from strategies.parallel.collectives import collective_device

#: A full tensor of row numbers -> (Hugging Face name, its rows of it), as the backend's
#: full-tensor conversion lays them out.
RowProbe = Callable[[torch.Tensor], Sequence[tuple[str, torch.Tensor]]]


def row_numbers(shape: Sequence[int]) -> torch.Tensor:
    """The row number of each row of a full tensor of ``shape``, shaped like it with one
    column (a vector's: one number per element)."""
    if len(shape) < 2:
        return torch.arange(math.prod(shape))
    return torch.arange(math.prod(shape[:-1])).reshape(*shape[:-1], 1)


@attrs.frozen(kw_only=True)
class ParamShard:
    """One parameter's local shard and the Hugging Face tensors of its full tensor.

    ``rows``: the full parameter's row (of its row view) each local row is; ``columns``: the
    ``[start, stop)`` of its columns held here. ``hf``: (name, shape, rows of the full
    parameter in the Hugging Face tensor's row order) of each Hugging Face tensor it makes up.
    ``dtype``: the exported dtype (None: the parameter's)."""

    name: str
    local: torch.Tensor
    rows: torch.Tensor
    columns: tuple[int, int]
    hf: tuple[tuple[str, tuple[int, ...], torch.Tensor], ...]
    dtype: torch.dtype | None = None

    @classmethod
    def probed(
        cls,
        name: str,
        local: torch.Tensor,
        full_shape: Sequence[int],
        rows: torch.Tensor,
        columns: tuple[int, int],
        probe: RowProbe,
        dtype: torch.dtype | None = None,
    ) -> ParamShard:
        """The shard whose Hugging Face tensors ``probe`` (the backend's full-tensor
        conversion) gives from the full parameter's row numbers."""
        full_columns = [int(full_shape[-1])] if len(full_shape) >= 2 else []
        hf = tuple(
            (
                hf_name,
                (*part.shape[:-1], *full_columns) if full_columns else tuple(part.shape),
                part.reshape(-1),
            )
            for hf_name, part in probe(row_numbers(full_shape))
        )
        return cls(name=name, local=local, rows=rows, columns=columns, hf=hf, dtype=dtype)


#: A block's place: (rows, columns) of the tensor's row view.
_Key = tuple[tuple[int, int], tuple[int, int]]


@attrs.frozen(kw_only=True)
class HfBlock:
    """What this rank holds of the Hugging Face tensor ``name`` of ``shape``: rows
    ``[rows[0], rows[1])`` x columns ``[columns[0], columns[1])`` of its row view, as
    ``tensor`` (shaped as those rows x columns; a vector's block a vector). Empty where this
    rank holds none of it. ``contributes`` is False for a copy of a block a lower rank holds
    too. ``tensor`` may be a view of the live weights: copy what you keep."""

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int]
    columns: tuple[int, int]
    tensor: torch.Tensor
    contributes: bool
    #: Every contributing block of the tensor: ((rows, columns), the rank that holds it).
    holders: tuple[tuple[_Key, int], ...] = ()

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> HfBlock:
        """The block of a tensor one rank holds whole (e.g. a full export's)."""
        block = cls(
            name=name,
            shape=tuple(tensor.shape),
            rows=(0, 0),
            columns=(0, 0),
            tensor=tensor,
            contributes=True,
        )
        rows, columns = block.row_view
        return attrs.evolve(block, rows=(0, rows), columns=(0, columns))

    @property
    def row_view(self) -> tuple[int, int]:
        """The Hugging Face tensor's (rows, columns)."""
        if len(self.shape) < 2:
            return math.prod(self.shape), 1
        return math.prod(self.shape[:-1]), self.shape[-1]

    def positions(self, local: torch.Tensor) -> torch.Tensor:
        """Flat positions in the Hugging Face tensor of the block's flat positions ``local``."""
        width = self.columns[1] - self.columns[0]
        if width == self.row_view[1]:  # whole rows: one contiguous run of the tensor
            return local + self.rows[0] * width if self.rows[0] else local
        row, column = local // width, local % width
        return (row + self.rows[0]) * self.row_view[1] + column + self.columns[0]

    def place(self, full: torch.Tensor) -> None:
        """Write the block into ``full``, a tensor of the block's Hugging Face tensor."""
        _write(full.view(self.row_view), (self.rows, self.columns), self.tensor)


def _write(view: torch.Tensor, key: _Key, block: torch.Tensor) -> None:
    (first, last), (left, right) = key
    view[first:last, left:right] = block.reshape(last - first, right - left)


def whole_tensors(blocks: Iterable[HfBlock]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor whole on every rank, from the ranks' blocks: one broadcast per contributing
    block from the rank that holds it (collective: every rank iterates to the end)."""
    me = dist.get_rank() if dist.is_initialized() else 0
    for block in blocks:
        device = block.tensor.device
        full = torch.empty(block.shape, dtype=block.tensor.dtype, device=device)
        view = full.view(block.row_view)
        for key, owner in block.holders:
            (first, last), (left, right) = key
            if owner == me:
                part = block.tensor.reshape(last - first, right - left).contiguous()
            else:
                part = torch.empty(last - first, right - left, dtype=full.dtype, device=device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(part, src=owner)
            _write(view, key, part)
        yield block.name, full


@attrs.frozen
class _Planned:
    """One block of this rank's, before its tensor is taken from the shard."""

    shard: ParamShard
    shape: tuple[int, ...]
    rows: tuple[int, int]
    local_rows: torch.Tensor

    def key(self) -> _Key:
        return self.rows, self.shard.columns

    def dtype(self) -> torch.dtype:
        return self.shard.dtype or self.shard.local.dtype

    def tensor(self) -> torch.Tensor:
        columns = self.shard.columns
        local = self.shard.local.detach().reshape(self.shard.rows.numel(), -1)
        first = int(self.local_rows[0])
        contiguous = torch.equal(
            self.local_rows, torch.arange(first, first + self.local_rows.numel())
        )
        block = (
            local.narrow(0, first, self.local_rows.numel())
            if contiguous
            else local.index_select(0, self.local_rows.to(local.device))
        )
        block = block if self.shard.dtype is None else block.to(self.shard.dtype)
        if len(self.shape) < 2:
            return block.reshape(-1)
        return block.reshape(self.rows[1] - self.rows[0], columns[1] - columns[0])


def _plan(shards: Iterable[ParamShard]) -> dict[str, _Planned]:
    """This rank's blocks by Hugging Face name (no tensor is copied)."""
    planned: dict[str, _Planned] = {}
    for shard in shards:
        if shard.rows.numel() == 0:  # e.g. FSDP2's shard of a one-row tensor on rank 1
            continue
        full_rows = max((int(rows.max()) + 1 for _, _, rows in shard.hf if rows.numel()), default=0)
        where = torch.full((max(full_rows, int(shard.rows.max()) + 1),), -1, dtype=torch.long)
        where[shard.rows] = torch.arange(shard.rows.numel())
        for name, shape, hf_rows in shard.hf:
            local_rows = where[hf_rows]
            held = (local_rows >= 0).nonzero().reshape(-1)
            if held.numel() == 0:
                continue
            first, last = int(held[0]), int(held[-1]) + 1
            if last - first != held.numel():
                raise EngineStateError(
                    f"{shard.name}: this rank's rows of {name} are not one block of it"
                )
            if name in planned:
                raise EngineStateError(f"{name}: this rank holds two parts of it")
            planned[name] = _Planned(shard, shape, (first, last), local_rows[first:last])
    return planned


def hf_blocks(shards: Iterable[ParamShard]) -> Iterator[HfBlock]:
    """Every Hugging Face tensor of the model as this rank's block of it, in one order on every
    rank (collective: every rank calls it; it exchanges the blocks' places once, not their
    values)."""
    planned = _plan(shards)
    mine = [(name, p.shape, p.key(), str(p.dtype())) for name, p in planned.items()]
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
    rank = dist.get_rank() if dist.is_initialized() else 0
    directory: dict[str, tuple[tuple[int, ...], str, dict[_Key, int]]] = {}
    for owner, blocks in enumerate(everyone):
        for name, shape, key, dtype in blocks:
            _, _, holders = directory.setdefault(name, (tuple(shape), dtype, {}))
            holders.setdefault(key, owner)
    device = collective_device() if dist.is_initialized() else torch.device("cpu")
    for name, (shape, dtype, holders) in directory.items():
        _check_tiling(name, shape, holders)
        part = planned.get(name)
        every = tuple(holders.items())
        if part is None:
            empty = torch.empty(
                0, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device
            )
            yield HfBlock(
                name=name,
                shape=shape,
                rows=(0, 0),
                columns=(0, 0),
                tensor=empty,
                contributes=False,
                holders=every,
            )
            continue
        yield HfBlock(
            name=name,
            shape=shape,
            rows=part.rows,
            columns=part.shard.columns,
            tensor=part.tensor(),
            contributes=holders[part.key()] == rank,
            holders=every,
        )


def _check_tiling(name: str, shape: tuple[int, ...], holders: dict[_Key, int]) -> None:
    """The distinct blocks of ``name`` cover it exactly once (a backend's shard description
    that does not is a bug, reported rather than exported wrong)."""
    rects = sorted(holders)
    covered = sum((rows[1] - rows[0]) * (cols[1] - cols[0]) for rows, cols in rects)
    overlap = any(
        a_rows[0] < b_rows[1]
        and b_rows[0] < a_rows[1]
        and a_cols[0] < b_cols[1]
        and b_cols[0] < a_cols[1]
        for i, (a_rows, a_cols) in enumerate(rects)
        for b_rows, b_cols in rects[i + 1 :]
    )
    if covered != math.prod(shape) or overlap:
        raise EngineStateError(
            f"{name}: the ranks' blocks (rows, columns) {rects} do not tile its shape {list(shape)}"
        )
