"""Micro-batch planning: which sequences of a batch run together, as pure functions of lengths.

RL batches mix prompts and responses of very different lengths, so a fixed number of sequences
per micro-batch either wastes compute on padding or runs out of memory on the long ones. The
planner instead fills micro-batches up to a *token budget* (``max_tokens_per_micro_batch``, the
``max_token_len_per_gpu`` of the reference behaviour), uses as few micro-batches as it can, and
balances the token load across them. With data parallelism every rank must run the same number
of micro-batches (pipeline schedules and DDP's gradient all-reduce count them), so
:func:`plan_for_data_parallel` agrees on the largest count with one all-reduce and re-plans.

A micro-batch's load is what it really allocates and computes: rows x longest row for a
right-padded micro-batch (:func:`engine.data.batching.split_into`), where count and balance are
exact (:mod:`engine.data.partition`); the sum of real tokens for a packed one (``packed=True``:
its sequences back to back in one row), where both come from bin-packing heuristics with known
bounds (:mod:`engine.data.bin_packing`).

The engine turns a plan into micro-batches with ``engine.data.batching.split_into(batch,
plan.groups)``; ``restore_outputs`` puts their outputs back in batch order.

Everything is deterministic: ties are broken by sequence index, never by hashing or timing.
Micro-batches run heaviest first, so an out-of-memory shows on the first one and the caching
allocator reuses the largest blocks; inside a micro-batch the indices are ascending.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import SupportsIndex, cast

import attrs
import torch
import torch.distributed as dist

from engine.data.bin_packing import packed_partition
from engine.data.partition import balanced_partition
from heads.errors import BatchError, ConfigError
from strategies.parallel.collectives import all_reduce_values

__all__ = [
    "MicroBatchPlan",
    "agree_on_count",
    "plan_fixed",
    "plan_for_data_parallel",
    "plan_token_budget",
]


@attrs.frozen(kw_only=True)
class MicroBatchPlan:
    """The micro-batches of one batch: sequence indices per micro-batch, in run order.

    Every sequence index ``0..num_sequences-1`` appears in exactly one group, and no group is
    empty (checked at construction).
    """

    #: Sequence indices of each micro-batch (ascending inside a group), in run order.
    groups: tuple[tuple[int, ...], ...]
    #: Real tokens of each micro-batch: what a packed micro-batch holds.
    tokens: tuple[int, ...]
    #: Rows x longest row of each micro-batch: what a right-padded micro-batch holds.
    padded_tokens: tuple[int, ...]
    #: The token budget the plan was made for (``None`` for a fixed-size plan).
    max_tokens_per_micro_batch: int | None = None
    #: Whether the micro-batches are packed, so the budget counts real tokens (else padded).
    packed: bool = False

    def __attrs_post_init__(self) -> None:
        if not len(self.groups) == len(self.tokens) == len(self.padded_tokens):
            raise BatchError("a MicroBatchPlan needs one token count per group")
        if any(not group for group in self.groups):
            raise BatchError("a MicroBatchPlan cannot have an empty micro-batch")
        seen = sorted(index for group in self.groups for index in group)
        if seen != list(range(len(seen))):
            raise BatchError("a MicroBatchPlan must cover sequences 0..n-1 exactly once")

    @property
    def num_micro_batches(self) -> int:
        return len(self.groups)

    @property
    def num_sequences(self) -> int:
        return sum(len(group) for group in self.groups)

    @property
    def loads(self) -> tuple[int, ...]:
        """Each micro-batch's load as the budget counts it (real tokens when packed)."""
        return self.tokens if self.packed else self.padded_tokens

    @property
    def max_load(self) -> int:
        return max(self.loads)


# ------------------------------------------------------------------------------ public planners


def plan_fixed(
    lengths: Sequence[int] | torch.Tensor, micro_batch_size: int, *, packed: bool = False
) -> MicroBatchPlan:
    """Consecutive micro-batches of ``micro_batch_size`` sequences (the last may be shorter),
    in batch order -- the same groups as :func:`engine.data.batching.split_fixed`."""
    sizes = _lengths(lengths)
    size = _positive_int(micro_batch_size, "micro_batch_size")
    groups = [
        list(range(start, min(start + size, len(sizes)))) for start in range(0, len(sizes), size)
    ]
    return _plan(groups, sizes, budget=None, packed=_flag(packed), heaviest_first=False)


def plan_token_budget(
    lengths: Sequence[int] | torch.Tensor,
    max_tokens_per_micro_batch: int,
    *,
    min_num_micro_batches: int = 1,
    packed: bool = False,
) -> MicroBatchPlan:
    """Fewest micro-batches whose load (rows x longest row; real tokens when ``packed``) fits
    ``max_tokens_per_micro_batch``, load-balanced.

    The count is ``max(fewest that fit, min_num_micro_batches)``; for that count the largest
    micro-batch load is the least possible (padded) or within the bin-packing bounds (packed;
    see the module docstring).

    Raises :class:`BatchError` when one sequence alone exceeds the budget -- it cannot fit any
    micro-batch, and running it anyway would break the memory limit the budget stands for, so
    truncate or filter it upstream -- and when ``min_num_micro_batches`` exceeds the number of
    sequences, because a micro-batch cannot be empty.
    """
    sizes = _lengths(lengths)
    budget = _positive_int(max_tokens_per_micro_batch, "max_tokens_per_micro_batch")
    minimum = _positive_int(min_num_micro_batches, "min_num_micro_batches")
    packed = _flag(packed)
    _check_fits(sizes, budget)
    if minimum > len(sizes):
        raise BatchError(
            f"min_num_micro_batches={minimum} exceeds the {len(sizes)} sequence(s) of the "
            "batch; a micro-batch cannot be empty, so the batch needs at least "
            f"{minimum} sequences"
        )
    partition = packed_partition if packed else balanced_partition
    groups = partition(sizes, budget, minimum)
    return _plan(groups, sizes, budget=budget, packed=packed, heaviest_first=True)


def agree_on_count(
    local_count: int,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str | None = None,
) -> int:
    """The largest ``local_count`` over the ranks of ``group`` (one MAX all-reduce).

    ``group=None`` means no data parallelism (not the default group): the count comes back
    unchanged, as it does for a group of one rank, without any collective. ``device`` is where
    the one-element tensor lives; by default the CPU for gloo groups and the current
    accelerator otherwise (NCCL/HCCL reduce device tensors only).
    """
    count = _positive_int(local_count, "local_count", error=BatchError)
    return _max_over_ranks([count], group, device)[0]


def plan_for_data_parallel(
    lengths: Sequence[int] | torch.Tensor,
    max_tokens_per_micro_batch: int,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str | None = None,
    packed: bool = False,
    count_multiple: int = 1,
) -> MicroBatchPlan:
    """This rank's plan, with the same number of micro-batches on every rank of ``group``.

    Plans locally, agrees on the largest count (one all-reduce, which also carries the smallest
    number of sequences of any rank and whether any rank failed), rounds it up to a multiple of
    ``count_multiple`` (a schedule that runs micro-batches in groups, e.g. megatron's
    interleaved pipeline), and re-plans with that count as the minimum. Every rank must call
    it. Errors are collective, so that no rank is left waiting in a later collective: when a
    rank's own planning fails (say an over-long sequence) it raises its error and the others
    raise a :class:`BatchError` pointing to it; when the agreed count exceeds the sequences of
    some rank, every rank raises the same :class:`BatchError` -- micro-batches cannot be empty,
    so each rank needs at least that many sequences.
    """
    failure: BatchError | ConfigError | None = None
    sizes: list[int] = []
    local: MicroBatchPlan | None = None
    multiple = 1
    try:
        multiple = _positive_int(count_multiple, "count_multiple")
        sizes = _lengths(lengths)
        local = plan_token_budget(sizes, max_tokens_per_micro_batch, packed=packed)
    except (BatchError, ConfigError) as error:
        failure = error  # raised after the all-reduce, so no other rank is left waiting in it
    local_count = local.num_micro_batches if local is not None else 0
    count, negative_fewest, failed = _max_over_ranks(
        [local_count, -len(sizes), int(failure is not None)], group, device
    )
    if failure is not None:
        raise failure
    if failed or local is None:
        raise BatchError(
            "another data-parallel rank could not plan its micro-batches (its own error says "
            "why); every rank stops here so that none waits in a later collective"
        )
    fewest = -negative_fewest
    needed = count
    count = -(-count // multiple) * multiple
    if count > fewest:
        rounded = f", rounded up to a multiple of {multiple}" if count != needed else ""
        raise BatchError(
            f"the data-parallel ranks need {count} micro-batches (the most any rank needs for "
            f"max_tokens_per_micro_batch={max_tokens_per_micro_batch}{rounded}), but a rank has "
            f"only {fewest} sequence(s) (this rank: {len(sizes)}); every rank runs the same number "
            f"of micro-batches and none may be empty, so each rank needs at least {count} "
            "sequences: spread the sequences more evenly over the ranks, give each rank more "
            "sequences, or raise max_tokens_per_micro_batch"
        )
    if count == local.num_micro_batches:
        return local
    return plan_token_budget(
        sizes, max_tokens_per_micro_batch, min_num_micro_batches=count, packed=packed
    )


# ----------------------------------------------------------------------------------- validation


def _positive_int(value: object, name: str, *, error: type[Exception] = ConfigError) -> int:
    if isinstance(value, bool):
        raise error(f"{name} must be a positive int, got {value!r}")
    try:
        number = operator.index(cast("SupportsIndex", value))
    except TypeError:
        raise error(
            f"{name} must be a positive int, got {type(value).__name__} {value!r}"
        ) from None
    if number < 1:
        raise error(f"{name} must be a positive int, got {number}")
    return number


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"packed must be a bool, got {value!r}")
    return value


def _lengths(lengths: Sequence[int] | torch.Tensor) -> list[int]:
    """Sequence lengths as a list of positive Python ints (a 1-D integer tensor is fine)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.is_complex():
            raise BatchError(
                f"lengths must be a 1-D integer tensor, got {lengths.dtype} of shape "
                f"{list(lengths.shape)}"
            )
        values: list[object] = list(lengths.tolist())
    else:
        values = list(lengths)
    if not values:
        raise BatchError("a batch needs at least one sequence to plan micro-batches")
    sizes: list[int] = []
    for index, value in enumerate(values):
        try:
            if isinstance(value, bool):
                raise TypeError
            size = operator.index(cast("SupportsIndex", value))
        except TypeError:
            raise BatchError(
                f"sequence {index}: length must be an int, got {type(value).__name__} {value!r}"
            ) from None
        if size < 1:
            raise BatchError(f"sequence {index} has length {size}; every sequence needs a token")
        sizes.append(size)
    return sizes


def _check_fits(sizes: Sequence[int], budget: int) -> None:
    over = [index for index, size in enumerate(sizes) if size > budget]
    if over:
        first = over[0]
        others = f" ({len(over) - 1} more sequence(s) too)" if len(over) > 1 else ""
        raise BatchError(
            f"sequence {first} has {sizes[first]} tokens, more than "
            f"max_tokens_per_micro_batch={budget}{others}; one sequence cannot be split "
            "across micro-batches: raise the budget or truncate/filter long sequences"
        )


# ----------------------------------------------------------------------------------- the plan


def _plan(
    groups: list[list[int]],
    sizes: Sequence[int],
    *,
    budget: int | None,
    packed: bool,
    heaviest_first: bool,
) -> MicroBatchPlan:
    ordered = [sorted(group) for group in groups]
    tokens = [sum(sizes[i] for i in group) for group in ordered]
    padded_tokens = [len(group) * max(sizes[i] for i in group) for group in ordered]
    order = list(range(len(ordered)))
    if heaviest_first:
        loads = tokens if packed else padded_tokens
        order.sort(key=lambda g: (-loads[g], ordered[g][0]))
    return MicroBatchPlan(
        groups=tuple(tuple(ordered[g]) for g in order),
        tokens=tuple(tokens[g] for g in order),
        padded_tokens=tuple(padded_tokens[g] for g in order),
        max_tokens_per_micro_batch=budget,
        packed=packed,
    )


# -------------------------------------------------------------------------------- collectives


def _max_over_ranks(
    values: list[int], group: dist.ProcessGroup | None, device: torch.device | str | None
) -> list[int]:
    """Element-wise max of ``values`` over the ranks of ``group`` with one all-reduce
    (``group=None``: no data parallelism, no collective)."""
    if group is None:
        return list(values)
    reduced = all_reduce_values(
        values, op=dist.ReduceOp.MAX, group=group, dtype=torch.int64, device=device
    )
    return [int(value) for value in reduced]
