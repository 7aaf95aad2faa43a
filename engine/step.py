"""One forward(-backward) step, prepared once and passed down.

:func:`prepare_step` takes the batch's sequence lengths once (on the host), counts its tokens,
sequences and per-token ``*mask`` sums, and sums them over the data-parallel ranks in one
all-reduce that also carries whether any rank refused its batch; then plans the micro-batches
from the lengths and splits the batch into micro-batches that carry their own lengths and row
indices. Backends run ``step.micro_batches`` and read ``step.global_tokens`` (no counting
again). What happens to each micro-batch's raw output is :class:`MicroBatchWork`, the consumer
a backend calls; :class:`BoundLoss` is the loss bound to one micro-batch, also what a fused head
asks for the loss's gradient.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine.data.batching import (
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    MicroBatch,
    field_names,
    fields,
    is_jagged,
    jagged_values,
    split_into,
)
from engine.data.micro_batching import MicroBatchPlan
from engine.host_values import Number
from engine.losses.contract import SCORED_TOKENS, SEQUENCES, LossContext, LossFn, checked_loss
from heads.base import Head, HeadContext, apply_head, apply_head_with_loss, check_results
from heads.errors import BatchError
from strategies.parallel.collectives import all_reduce_values, world_size

T = TypeVar("T")

REFUSED_ELSEWHERE = (
    "another data-parallel rank's batch was refused (its own error says why); every rank stops "
    "here, so that none runs this step without it"
)


@attrs.frozen(kw_only=True)
class Step:
    """A validated batch split into micro-batches, with the counts its losses normalise by."""

    #: The batch, checked and jagged.
    rows: TensorDict
    #: Real tokens of each sequence (host).
    lengths: torch.Tensor
    plan: MicroBatchPlan
    micro_batches: list[MicroBatch]
    #: Sums over the data-parallel ranks (``LossContext.global_counts``).
    global_counts: dict[str, float]

    @property
    def global_tokens(self) -> float:
        """Real tokens of the step over the data-parallel ranks."""
        return self.global_counts[SCORED_TOKENS] + self.global_counts[SEQUENCES]


def prepare_step(
    batch: object,
    checked: tuple[TensorDict, torch.Tensor] | BatchError,
    plan: Callable[[torch.Tensor], MicroBatchPlan],
    group: dist.ProcessGroup | None,
) -> Step:
    """The step of ``batch`` (``checked``: its rows and sequence lengths, checked on this rank,
    or why it was refused), ``plan``
    made from its lengths; collective over ``group``: a batch refused on one rank is refused
    on every rank, so that none goes on into the step's collectives without it."""
    # a fixed-size vector: a refusing rank (whose batch may lack a field) sends as many
    # numbers as the others; each mask's slot carries its name's checksum beside its sum
    names = _mask_names(batch)
    if len(names) > MASK_SLOTS:
        checked = BatchError(
            f"a batch has at most {MASK_SLOTS} per-token fields named *mask; this one has "
            f"{len(names)}: {', '.join(names)}"
        )
    if isinstance(checked, BatchError):
        all_reduce_values([1.0, 0.0, 0.0, *[0.0] * (2 * MASK_SLOTS)], group=group)
        raise checked
    rows, lengths = checked
    masks = {name: value for name, value in fields(rows) if _counted(name, value)}
    slots = [0.0] * (2 * MASK_SLOTS)
    for index, name in enumerate(names):
        slots[2 * index] = float(_checksum(name))
        if name in masks:
            slots[2 * index + 1] = float(jagged_values(masks[name]).float().sum())
    total = all_reduce_values(
        [0.0, float((lengths - 1).sum()), float(len(lengths)), *slots], group=group
    )
    refused, scored, sequences, summed = total[0], total[1], total[2], total[3:]
    if refused:
        raise BatchError(REFUSED_ELSEWHERE)
    ranks = _group_size(group)
    if any(summed[2 * i] != ranks * slots[2 * i] for i in range(MASK_SLOTS)):  # on every rank
        raise BatchError(
            "the data-parallel ranks' batches have different per-token *mask fields (this "
            f"rank's: {', '.join(names) or 'none'}); every rank's batch needs the same fields"
        )
    totals = {name: summed[2 * i + 1] for i, name in enumerate(names)}
    counts = {SCORED_TOKENS: scored, SEQUENCES: sequences}
    counts.update({name: totals[name] for name in masks})
    planned = plan(lengths)
    micro_batches = split_into(rows, planned.groups, packed=planned.packed, lengths=lengths)
    return Step(
        rows=rows, lengths=lengths, plan=planned, micro_batches=micro_batches, global_counts=counts
    )


def refused_everywhere(checked: T | BatchError, group: dist.ProcessGroup | None) -> T | BatchError:
    """``checked``, or a BatchError when another rank of ``group`` refused its batch (one
    all-reduce), outside a step (whose counts carry the refusal)."""
    (refused,) = all_reduce_values([float(isinstance(checked, BatchError))], group=group)
    return BatchError(REFUSED_ELSEWHERE) if refused else checked


#: How many ``*mask`` fields a step counts (their slots are in every rank's count vector).
MASK_SLOTS = 16


def _checksum(name: str) -> int:
    """A field name as a number below 2**24 (exact in the float64 sum of up to 2**29 ranks)."""
    return zlib.crc32(name.encode()) % (1 << 24) + 1


def _group_size(group: dist.ProcessGroup | None) -> int:
    return world_size() if group is None else dist.get_world_size(group)


def _counted(name: str, value: torch.Tensor) -> bool:
    return name.endswith("mask") and is_jagged(value)


def _mask_names(batch: object) -> list[str]:
    """The ``*mask`` field names of ``batch`` as given (``loss_mask`` for ``labels``): the same
    on every rank whose batch has the same fields, whether or not it is refused."""
    if not isinstance(batch, TensorDict):
        return []
    names = [name for name in field_names(batch) if name.endswith("mask")]
    if LABELS in batch.keys() and LOSS_MASK not in names:
        names.append(LOSS_MASK)
    return names


@attrs.define
class StepResults:
    """What a step left on the device, its numbers not yet fetched (one transfer at its end)."""

    step: Step
    #: Per micro-batch: the loss (a detached one-element tensor), the loss's metrics, and the
    #: head's outputs (detached; when the call returns them).
    losses: list[Number]
    metrics: list[Mapping[str, Number]]
    produced: list[dict[str, torch.Tensor]]
    #: Head-contract checks left on the device: (violated, message).
    checks: list[tuple[torch.Tensor, str]] = attrs.field(factory=list)
    holds_outputs: bool = False
    #: The outputs in input order (output ranks, when the call returns them).
    outputs: TensorDict | None = None

    @classmethod
    def of(cls, step: Step) -> StepResults:
        count = len(step.micro_batches)
        return cls(
            step=step,
            losses=[0.0] * count,
            metrics=[{} for _ in range(count)],
            produced=[{} for _ in range(count)],
        )


@attrs.frozen(kw_only=True)
class BoundLoss:
    """The loss function bound to one micro-batch (its fields on the device and its context),
    called with the head's results; what a fused head asks for the loss's gradient."""

    loss_function: LossFn
    micro_batch: MicroBatch
    data: TensorDict
    ctx: LossContext
    per_token: frozenset[str]

    def __call__(self, results: Mapping[str, torch.Tensor]) -> torch.Tensor:
        outputs = self.micro_batch.right_padded(results, self.per_token)
        return self.value(outputs, training=True)[0]

    def value(
        self, outputs: Mapping[str, torch.Tensor], *, training: bool
    ) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        """The checked ``(loss, metrics)`` of right-padded ``outputs``."""
        return checked_loss(self.loss_function(outputs, self.data, self.ctx), training=training)


@attrs.frozen(kw_only=True)
class MicroBatchWork:
    """The consumer a backend calls with each micro-batch's raw output: the head, its checks,
    the loss; records the step's numbers in ``results``."""

    head: Head
    loss_function: LossFn | None
    forward_only: bool
    return_outputs: bool
    device: torch.device
    data_parallel_size: int
    #: The head's per-token results (unpacked for the loss when packed).
    per_token: frozenset[str]
    results: StepResults
    #: A fused LM head then computes the loss's gradient in its forward pass.
    separable: bool

    def __call__(
        self, index: int, raw: torch.Tensor, head_ctx: HeadContext
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        device, results = self.device, self.results
        step = results.step
        micro_batch = step.micro_batches[index]
        # host-to-device copies that do not wait for the device's queue
        data = micro_batch.data.to(device, non_blocking=True)
        packed = micro_batch.cu_seqlens
        head_ctx = attrs.evolve(
            head_ctx,
            deferred_checks=results.checks,
            sequence_lengths=micro_batch.lengths,
            cu_seqlens=None if packed is None else packed.to(device, non_blocking=True),
        )
        # the ids the model ran on: the padded ones are already on the device with ``data``
        model_ids = (
            data[INPUT_IDS]
            if packed is None
            else micro_batch.input_ids.to(device, non_blocking=True)
        )
        ctx = LossContext(
            micro_batch_index=index,
            num_micro_batches=len(step.micro_batches),
            data_parallel_size=self.data_parallel_size,
            global_counts=step.global_counts,
            rows=micro_batch.indices,
        )
        loss_fn = self.loss_function
        bound = None
        if loss_fn is not None:
            bound = BoundLoss(
                loss_function=loss_fn,
                micro_batch=micro_batch,
                data=data,
                ctx=ctx,
                per_token=self.per_token,
            )
        anchor = None
        if self.separable and bound is not None:
            outputs, anchor = apply_head_with_loss(self.head, raw, model_ids, head_ctx, bound)
        else:
            outputs = apply_head(self.head, raw, model_ids, head_ctx)
        check_results(self.head, outputs, model_ids, head_ctx, deferred=results.checks)
        outputs = micro_batch.right_padded(outputs, self.per_token)
        if self.return_outputs:
            results.produced[index] = {key: value.detach() for key, value in outputs.items()}
        if bound is None:
            return raw.sum() * 0.0, {}
        training = not self.forward_only and anchor is None
        loss, metrics = bound.value(outputs, training=training)
        if anchor is not None:  # the outputs are detached: the anchor carries the gradient
            loss = loss.detach() + anchor
        results.losses[index] = loss.detach()
        results.metrics[index] = metrics
        return loss, metrics
