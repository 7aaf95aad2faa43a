"""What megatron's pipeline schedules call for one step: the micro-batches' row layouts (built
once per step), the forward step (``forward_step_func``) and the loss bound to each
micro-batch (the ``loss_func`` a forward step returns).

Padding goes at the end of each row (never inside a sequence); the head never sees it: the raw
output is cut back to the micro-batch's own layout (``RowLayout.to_caller``). With context
parallelism each rank runs its part of every row, and so does the head on the last stage: only
its per-token results are gathered (``context_parallel``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from heads.base import HeadContext
from strategies.backends.base import MicroBatch, MicroBatchConsumer
from strategies.backends.megatron.context_parallel import Layout, row_params
from strategies.backends.megatron.model import output_weight
from strategies.backends.megatron.moe_routers import Routing
from strategies.model.row_layout import RowLayout, row_layouts


def step_layouts(micro_batches: Sequence[MicroBatch], model_config: Any) -> list[RowLayout]:
    """Each micro-batch's rows as the model runs them: its own length, or the batch's longest
    where megatron's schedule sends one fixed shape (virtual pipeline stages; and every
    pipeline schedule for packed rows), rounded up to a multiple of the tensor-parallel size
    under sequence parallelism (which splits the sequence dimension) and of 2 x CP under context
    parallelism (where a packed row first pads each of its sequences to 2 x CP)."""
    cp = model_config.context_parallel_size
    packed = micro_batches[0].cu_seqlens is not None
    pipeline = model_config.pipeline_model_parallel_size > 1
    multiple = model_config.tensor_model_parallel_size if model_config.sequence_parallel else 1
    if cp > 1:  # 2 x CP chunks, each split again under SP
        multiple *= 2 * cp
    return row_layouts(
        micro_batches,
        context_parallel_size=cp,
        multiple=multiple,
        same_width=model_config.virtual_pipeline_model_parallel_size is not None
        or (packed and pipeline),
    )


@attrs.frozen(kw_only=True)
class ModelInputs:
    """One micro-batch's inputs to a model chunk: token ids and positions ``[rows, width]``
    (this rank's part of them under context parallelism), megatron's ``packed_seq_params``,
    and the context-parallel layout."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    packed_seq_params: Any
    layout: Layout | None

    @classmethod
    def of(
        cls,
        micro_batch: MicroBatch,
        row: RowLayout,
        device: torch.device,
        *,
        context_group: Any,
        local_attention: bool,
        ring_attention: bool = False,
    ) -> ModelInputs:
        """``micro_batch``'s inputs laid out as ``row`` says (``local_attention``: the local
        layer spec's core attention, which reads the layout from ``packed_seq_params``; with
        ``ring_attention``, ring attention's under context parallelism)."""
        input_ids = micro_batch.input_ids.to(device=device, dtype=torch.long, non_blocking=True)
        if row.width > row.length:
            input_ids = torch.nn.functional.pad(input_ids, (0, row.width - row.length))
        real = row.real_positions
        if real is not None:  # each sequence padded to 2 x CP chunks
            input_ids = torch.zeros_like(input_ids).index_copy_(
                1, real.to(device), input_ids[:, : row.length]
            )
        positions = row.positions_on(device).expand_as(input_ids)
        layout = None
        if context_group is not None:
            layout = Layout.over(row, context_group, device)
            input_ids, positions = layout.split(input_ids, 1), layout.split(positions, 1)
        params = row_params(
            row,
            device,
            host_offsets=local_attention,
            context=layout if local_attention else None,
            ring=ring_attention,
        )
        return cls(
            input_ids=input_ids, positions=positions, packed_seq_params=params, layout=layout
        )

    def keywords(self) -> dict[str, Any]:
        """The model's keyword arguments beside the ids and positions."""
        extra: dict[str, Any] = {"attention_mask": None}
        if self.packed_seq_params is not None:
            extra["packed_seq_params"] = self.packed_seq_params
        return extra


@attrs.frozen(kw_only=True)
class BoundLoss:
    """megatron's ``loss_func`` for one micro-batch: the raw output back in the caller's
    layout, handed to the consumer; under context parallelism every rank's loss is the same,
    so each sends back its share (see ``context_parallel``)."""

    consume: MicroBatchConsumer
    index: int
    row: RowLayout
    layout: Layout | None
    context: HeadContext
    #: The head applies the output layer itself: the chunk whose output weight it reads.
    fused_chunk: torch.nn.Module | None

    def __call__(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        context = self.context  # on the last stage only
        if self.fused_chunk is not None:  # the raw output is the hidden states
            context = attrs.evolve(context, output_weight=output_weight(self.fused_chunk))
        if self.layout is not None:  # the head runs on this rank's part (heads.base)
            context = attrs.evolve(context, sequence_split=self.layout.head_split())
        else:
            raw = self.row.to_caller(raw)
        loss, metrics = self.consume(self.index, raw, context)
        if self.layout is not None:
            loss = loss / self.layout.size
        return loss, torch.ones((), dtype=torch.int), metrics


@attrs.frozen(kw_only=True)
class ForwardStep:
    """megatron's ``forward_step_func`` for one step: each micro-batch's rows as its layout
    says, through the model chunk the schedule names, and the loss bound to it."""

    rows: Sequence[RowLayout]
    device: torch.device
    consume: MicroBatchConsumer
    head_context: HeadContext
    fused: bool
    #: The model chunks, and the wrapped modules the schedule calls (index for index).
    chunks: Sequence[torch.nn.Module]
    wrapped: Sequence[torch.nn.Module]
    routing: Routing
    #: The ranks each row is split over (context parallelism), or None.
    context_group: Any
    local_attention: bool
    ring_attention: bool

    def __call__(
        self, iterator: Iterator[tuple[int, MicroBatch]], model: torch.nn.Module
    ) -> tuple[Any, BoundLoss]:
        index, micro_batch = next(iterator)
        row = self.rows[index]
        chunk = next(i for i, module in enumerate(self.wrapped) if module is model)
        inputs = ModelInputs.of(
            micro_batch,
            row,
            self.device,
            context_group=self.context_group,
            local_attention=self.local_attention,
            ring_attention=self.ring_attention,
        )
        extra = inputs.keywords()
        if self.routing.is_moe:  # routers leave the padding out of their losses and counts
            extra["padding_mask"] = self.routing.before_forward(
                chunk, index, micro_batch, row, self.device, inputs.layout
            )
        output = model(inputs.input_ids, inputs.positions, **extra)
        loss = BoundLoss(
            consume=self.consume,
            index=index,
            row=row,
            layout=inputs.layout,
            context=self.head_context,
            fused_chunk=self.chunks[chunk] if self.fused else None,
        )
        return output, loss
