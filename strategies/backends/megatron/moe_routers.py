"""Mixture-of-experts routers of a megatron model: load statistics, the aux-loss scale, and
router replay (the experts recorded for each token in one forward are forced in later ones).

Each ``TopKRouter`` of this rank's chunks gets a :class:`RouteSlot` as its ``router_replay``:
megatron asks it for the top-k of every forward, so one object sees every routing decision
without changing any (it calls megatron's own top-k unless a route is forced). A forced route
takes its weights from the live scores of the forced experts, as megatron's replay does: the
router still gets a gradient, and a drifted route never reads a zero weight.

Token order is megatron's: a micro-batch's ``[b, width]`` rows run as ``[width, b]`` and the
router sees them flattened, position-major. Under context parallelism each rank runs its
positions of the rows (``context_parallel.Layout``), and under sequence parallelism each
tensor-parallel rank routes its own contiguous part of that order: a rank forces its part of
the routes and records it, and the recorded parts are gathered over the groups.
Routes leave and enter the engine right-padded, ``[b, s, num_moe_layers, top_k]``, in the rows of
the micro-batch.

Micro-batches reach each router in order (every pipeline schedule runs a chunk's forwards, and
its backwards, in micro-batch order), so one queue per router holds the forced routes of the
forwards to come, and one the routes to force again when activation recompute re-runs a
forward inside the backward pass.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from strategies.backends.base import MicroBatch
from strategies.backends.megatron.context_parallel import Layout
from strategies.model.row_layout import RowLayout
from strategies.parallel.collectives import all_reduce_values, collective_device

#: Metric names per MoE layer (0-based global layer number).
AUX_LOSS = "router/layer_{}/aux_loss"
Z_LOSS = "router/layer_{}/z_loss"
LOAD = "router/layer_{}/load_max_over_mean"
#: megatron's tracker names for the aux and z losses, and the metric each becomes.
_TRACKED = {"load_balancing_loss": AUX_LOSS, "z_loss": Z_LOSS}


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (activation recompute re-runs forwards
    there)."""
    return bool(torch._C._current_graph_task_id() != -1)


class RouteSlot:
    """What one router chose, and what it is told to choose (megatron's ``router_replay``)."""

    def __init__(self, layer: int, num_experts: int, record: bool) -> None:
        self.layer = layer
        self.num_experts = num_experts
        self.record = record
        #: Tokens routed to each expert since the last ``reset`` (forwards only).
        self.load: torch.Tensor | None = None
        self.recorded: list[torch.Tensor] = []
        self.forced: collections.deque[torch.Tensor] = collections.deque()
        self.forced_again: collections.deque[torch.Tensor] = collections.deque()
        #: Which tokens of the forwards to come are real (not padding), in router order.
        self.real: collections.deque[torch.Tensor] = collections.deque()

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k (scores, expert ids) of ``scores`` ``[tokens, experts]``, or the forced
        experts and their live scores."""
        recompute = _in_backward()
        queue = self.forced_again if recompute else self.forced
        if queue:
            chosen = queue.popleft().to(scores.device)
            if not recompute:
                self.forced_again.append(chosen)
            probs, indices = scores.gather(1, chosen), chosen
        else:
            assert default_compute_topk is not None
            probs, indices = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
        if not recompute:
            real = self.real.popleft() if self.real else slice(None)
            counts = torch.bincount(indices[real].flatten(), minlength=self.num_experts)
            self.load = counts if self.load is None else self.load + counts
            if self.record:
                self.recorded.append(indices.detach())
        return probs, indices

    def reset(self) -> None:
        self.load = None
        self.recorded.clear()
        self.forced.clear()
        self.forced_again.clear()
        self.real.clear()


class Routing:
    """The route slots of this rank's model chunks (empty for a dense model)."""

    def __init__(
        self,
        slots_per_chunk: list[list[RouteSlot]],
        num_layers: int,
        top_k: int,
        sequence_group: dist.ProcessGroup | None = None,
        split_group: dist.ProcessGroup | None = None,
    ):
        self.slots_per_chunk = slots_per_chunk
        self.num_layers = num_layers
        self.top_k = top_k
        #: The ranks that split each sequence's part contiguously (sequence parallelism), or None.
        self.sequence_group = sequence_group
        #: Every rank that routes part of each sequence (sequence x context parallel), or None.
        self.split_group = split_group
        #: The step's micro-batches' row layouts (given at ``reset``).
        self.rows: Sequence[RowLayout] = ()
        #: Context parallelism: each micro-batch's split over the ranks.
        self.layouts: dict[int, Layout] = {}

    @classmethod
    def attach(
        cls,
        chunks: Sequence[torch.nn.Module],
        record: bool,
        sequence_group: dist.ProcessGroup | None = None,
        split_group: dist.ProcessGroup | None = None,
    ) -> Routing:
        """Give every router of ``chunks`` a slot (``record``: keep each forward's routes;
        ``sequence_group`` / ``split_group``: see the attributes)."""
        from megatron.core.transformer.moe.router import TopKRouter

        slots_per_chunk: list[list[RouteSlot]] = []
        num_layers = top_k = 0
        for chunk in chunks:
            slots = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    slot = RouteSlot(int(module.layer_number) - 1, module.num_experts, record)
                    module.router_replay = slot
                    slots.append(slot)
                    num_layers, top_k = int(module.config.num_layers), int(module.topk)
            slots_per_chunk.append(slots)
        return cls(slots_per_chunk, num_layers, top_k, sequence_group, split_group)

    def _own_part(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tokens`` in router order (all of them without sequence
        parallelism)."""
        if self.sequence_group is None:
            return tokens
        size = dist.get_world_size(self.sequence_group)
        rank = dist.get_rank(self.sequence_group)
        return tokens.chunk(size)[rank]

    def _summed(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of ``parts`` summed over the ranks that split each sequence (as it is without
        them)."""
        if self.split_group is None or not parts:
            return parts
        flat = torch.cat([part.flatten().double() for part in parts]).tolist()
        totals = torch.tensor(all_reduce_values(flat, group=self.split_group), dtype=torch.float64)
        sums = totals.split([part.numel() for part in parts])
        return [total.view_as(part).to(part.dtype) for total, part in zip(sums, parts, strict=True)]

    def _whole(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of this rank's ``parts`` (router order) joined with the other sequence-parallel
        ranks' (one all-gather for all of them)."""
        if self.sequence_group is None or not parts:
            return parts
        flat = torch.cat([part.flatten() for part in parts])
        flat = flat.to(collective_device(self.sequence_group))
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(self.sequence_group))]
        dist.all_gather(gathered, flat, group=self.sequence_group)
        sizes = [part.numel() for part in parts]
        per_rank = [whole.cpu().split(sizes) for whole in gathered]
        return [
            torch.cat([pieces[index].view_as(part) for pieces in per_rank])
            for index, part in enumerate(parts)
        ]

    @property
    def slots(self) -> list[RouteSlot]:
        return [slot for slots in self.slots_per_chunk for slot in slots]

    @property
    def is_moe(self) -> bool:
        return bool(self.num_layers)

    def reset(self, rows: Sequence[RowLayout] = ()) -> None:
        """Forget the last step's routes; ``rows``: the layouts of the step to come."""
        for slot in self.slots:
            slot.reset()
        self.rows = rows
        self.layouts.clear()

    def before_forward(
        self,
        chunk: int,
        index: int,
        micro_batch: MicroBatch,
        row: RowLayout,
        device: torch.device,
        layout: Layout | None = None,
    ) -> torch.Tensor:
        """Prepare chunk ``chunk``'s routers for micro-batch ``index`` laid out as ``row``
        (``layout``: split over context-parallel ranks): the tokens to count, and the routes to
        force where it carries them. Returns megatron's padding mask ``[rows, width / CP]``
        (True: padding)."""
        padding = padding_mask(micro_batch, row).to(device)
        if layout is not None:
            padding = layout.split(padding, 1)
            self.layouts[index] = layout
        real = self._own_part(~padding.transpose(0, 1).reshape(-1))
        routes = micro_batch.routed_experts
        tokens = None
        if routes is not None:
            ordered = model_order(routes.to(device), micro_batch, row)
            if layout is not None:  # [width * rows, ...] -> this rank's positions
                rows = padding.shape[0]
                ordered = ordered.view(row.width, rows, *ordered.shape[1:])
                ordered = layout.split(ordered, 0).flatten(0, 1)
            tokens = self._own_part(ordered)
        for slot in self.slots_per_chunk[chunk]:
            slot.real.append(real)
            if tokens is not None:
                slot.forced.append(tokens[:, slot.layer].contiguous())
        return padding

    def recorded_routes(
        self,
        micro_batches: Sequence[MicroBatch],
        pipeline_group: dist.ProcessGroup | None,
    ) -> list[torch.Tensor]:
        """Each micro-batch's recorded routes, right-padded ``[b, s, layers, k]`` (int64), laid
        out as the step's rows were; every pipeline stage contributes its own layers
        (collective over ``pipeline_group``)."""
        recorded = self._whole(
            [
                slot.recorded[index].to("cpu", torch.long)
                for index in range(len(micro_batches))
                for slot in self.slots
            ]
        )
        outputs = []
        count = len(self.slots)
        for index, (micro_batch, row) in enumerate(zip(micro_batches, self.rows, strict=True)):
            rows, length = micro_batch.attention_mask.shape
            chosen = recorded[index * count : (index + 1) * count]
            if index in self.layouts and chosen:  # this rank's positions -> the whole rows
                layout = self.layouts[index]
                local = torch.stack(chosen, dim=1).view(-1, row.rows, count, self.top_k)
                whole = layout.gather(local.to(layout.device), 0).cpu()
                chosen = list(whole.flatten(0, 1).unbind(1))
            routes = torch.zeros(rows, length, self.num_layers, self.top_k, dtype=torch.long)
            for slot, taken in zip(self.slots, chosen, strict=True):
                routes[:, :, slot.layer] = rows_order(taken, micro_batch, row, length)
            outputs.append(routes)
        if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
            flat = torch.cat([routes.flatten() for routes in outputs])
            flat = flat.to(collective_device(pipeline_group))
            dist.all_reduce(flat, group=pipeline_group)
            flat = flat.cpu()
            outputs = [
                part.view_as(routes)
                for part, routes in zip(
                    flat.split([routes.numel() for routes in outputs]), outputs, strict=True
                )
            ]
        return outputs

    def statistics(self, num_forwards: int, pipeline_group: dist.ProcessGroup | None) -> dict:
        """Per MoE layer: the load balance of the forwards since ``reset`` (the most tokens any
        expert got over the mean) and the mean aux / z losses megatron tracked (training
        forwards only); every pipeline stage contributes its own layers (collective)."""
        from megatron.core.transformer.moe import moe_utils

        if not self.is_moe:
            return {}
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        # one row per tracked loss, whether or not this rank tracked it, then the load: every
        # pipeline stage reduces the same shape
        values = torch.zeros(len(_TRACKED) + 1, self.num_layers, dtype=torch.float64)
        counted = [(slot, slot.load) for slot in self.slots if slot.load is not None]
        # sequence-parallel ranks route parts of the same tokens: their counts add up
        loads = self._summed([torch.stack([load for _, load in counted])]) if counted else []
        for (slot, _), load in zip(counted, loads[0].double() if loads else [], strict=True):
            values[-1, slot.layer] = float(load.max() / load.mean().clamp_min(1e-30))
        tracked = [name for name in _TRACKED if name in tracker]
        for row, name in enumerate(_TRACKED):
            if name in tracked:
                layer_values = tracker[name]["values"].detach().double().cpu()
                values[row] = layer_values[: self.num_layers] / max(num_forwards, 1)
        if self.split_group is not None:  # each rank tracked its part's mean losses
            (losses,) = self._summed([values[:-1]])
            values[:-1] = losses / dist.get_world_size(self.split_group)
        moe_utils.clear_aux_losses_tracker()
        if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
            values = values.to(collective_device(pipeline_group))
            dist.all_reduce(values, group=pipeline_group)
            values = values.cpu()
        shown = [
            (row, metric) for row, (name, metric) in enumerate(_TRACKED.items()) if name in tracked
        ]
        shown.append((len(_TRACKED), LOAD))
        return {
            metric.format(layer): float(values[row, layer])
            for row, metric in shown
            for layer in range(self.num_layers)
        }


def padding_mask(micro_batch: MicroBatch, row: RowLayout) -> torch.Tensor:
    """``[rows, width]`` True where the model's rows hold padding (packed: one row, its real
    tokens first, or where the layout puts them)."""
    width, positions = row.width, row.real_positions
    if micro_batch.cu_seqlens is not None:
        if positions is not None:
            return torch.ones(width, dtype=torch.bool).index_fill_(0, positions.cpu(), False)[None]
        return (torch.arange(width) >= int(micro_batch.cu_seqlens[-1]))[None]
    real = micro_batch.attention_mask.bool()
    return ~torch.nn.functional.pad(real, (0, width - real.shape[1]))


def model_order(routes: torch.Tensor, micro_batch: MicroBatch, row: RowLayout) -> torch.Tensor:
    """Right-padded routes ``[b, s, layers, k]`` -> ``[width * b, layers, k]``, in the order the
    router sees the micro-batch's tokens laid out as ``row`` (packed: the real tokens back to
    back in one row, or where the layout puts them). Padding is routed to experts 0..k-1
    (distinct, so every token has k experts)."""
    width, positions = row.width, row.real_positions
    real = micro_batch.attention_mask.to(routes.device)
    rows, length, layers, k = routes.shape
    filler = torch.arange(k, device=routes.device).expand(layers, k)
    routes = torch.where(real[..., None, None], routes, filler)
    if micro_batch.cu_seqlens is not None:
        tokens = routes[real]
        if positions is not None:
            placed = filler.expand(width, layers, k).clone()
            placed[positions.to(routes.device)] = tokens
            return placed
        return torch.cat([tokens, filler.expand(width - len(tokens), layers, k)])
    padded = torch.cat([routes, filler.expand(rows, width - length, layers, k)], dim=1)
    return padded.transpose(0, 1).reshape(width * rows, layers, k)


def rows_order(
    chosen: torch.Tensor, micro_batch: MicroBatch, row: RowLayout, length: int
) -> torch.Tensor:
    """Inverse of :func:`model_order` for one layer: ``[width * b, k]`` -> ``[b, s, k]``."""
    width, positions = row.width, row.real_positions
    if micro_batch.cu_seqlens is not None:
        if positions is not None:
            chosen = chosen[positions.cpu()]
        return micro_batch.unpack(chosen[None])
    rows = len(chosen) // width
    return chosen.view(width, rows, -1).transpose(0, 1)[:, :length]
