"""A verl checkpoint engine for hosts without an accelerator: weights from the trainer to rollout
replicas apart from it (verl's ``separate_async`` trainer), over gloo.

verl moves weights between a trainer and rollout replicas on other resources through a
checkpoint engine (``actor_rollout_ref.rollout.checkpoint_engine.backend``); every one it ships
needs an accelerator (NCCL, HCCL, NIXL) or an external store (Mooncake), and its ``naive``
engine serves colocated replicas only. This one, registered by the plug-in as
:data:`~engine.integrations.verl.cells.CHECKPOINT_ENGINE`, has the shape of verl's NCCL engine
with gloo as the transport:

- ``prepare`` (every sync, on every trainer and rollout worker): the trainer's rank 0 (verl's
  ``is_master``) starts a TCP store on a free port and returns its address;
- ``build_topology``: the trainer's rank 0 sends (rank 0 of the group), the other trainer ranks
  stay out (rank -1: they only walk the weights, whose export is collective over them), the
  rollout workers receive (ranks 1..N);
- ``init_process_group``: a gloo group of its own over that store (not the trainer's default
  group, which the rollout workers are not part of), and on each of its ranks a host bucket of
  ``update_weights_bucket_megabytes``;
- ``send_weights``: the weights cut into chunks of at most a bucket (verl's
  ``split_weight_chunks``), packed into buckets, each broadcast after a small header (the
  bucket's tensor metadata, its length, whether it is the last);
- ``receive_weights``: each bucket received and its tensors yielded whole (verl's
  ``merge_weight_chunks``), copied out of the bucket, which the next one overwrites;
- ``finalize``: the group, the store and the bucket are dropped; the next sync builds them again.

**Deltas** (``engine_kwargs: {composable_gloo: {delta: true}}``): the trainer's rank 0 keeps the
last weights it sent as a host base (:class:`~engine.weight_sync.DeltaExport` over whole
tensors: one copy of the model in its memory) and sends only the elements that changed bit for
bit since, as (positions, values) pairs; the receiver yields each as a
:class:`~engine.weight_sync.WeightPatch`, which the generator writes into the weights it holds
(no copy on that side); a tensor most of which changed goes whole, which is then smaller than
positions and values. verl hands every engine but its own ``delta_sharded`` the trainer's full
export, so the changes are found here, from that export. The first sync, and any whose tensors
are not the base's (LoRA adapters synced alone are always sent whole), sends the weights whole
and takes them as the base. Each sync returns ``checkpoint_engine/payload_mbytes`` and
``checkpoint_engine/changed_ratio`` (verl logs them). What a delta saves is bytes on the wire;
finding it costs a compare of the whole model on the sender.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, merge_weight_chunks, split_weight_chunks

from engine.weight_sync import DeltaExport, WeightPatch
from heads.errors import ConfigError
from strategies.hf.shards import HfBlock
from strategies.model.peft_lora import PEFT_PREFIX

#: verl's name for a stream of ``(name, tensor)`` pairs; with deltas on, the stream also
#: carries ``(name, WeightPatch)`` pairs, which the ``composable_hf`` server adapter applies.
NAMED_TENSORS = "named_tensors"
PATCHES = "named_tensors_and_patches"
#: A patch travels as two tensors, its name followed by one of these (no tensor name has a NUL),
#: or, where most of the tensor changed, as the whole tensor under its name and ``_WHOLE``.
_POSITIONS, _VALUES, _WHOLE = "\x00positions", "\x00values", "\x00whole"


class GlooCheckpointEngine(CheckpointEngine):
    """Weights broadcast from the trainer's rank 0 to the rollout workers over gloo.

    Args:
        bucket_size: bytes of one bucket (verl passes ``update_weights_bucket_megabytes``).
        is_master: the trainer's rank 0 (verl passes it).
        timeout_s: how long a rank waits for the others (``engine_kwargs``).
        host: the address the other ranks reach rank 0's store at (default: the Ray node's).
        delta: send the elements changed since the last sync only (``engine_kwargs``; see the
            module).
    """

    #: What ``engine_kwargs`` may set.
    SETTINGS = ("timeout_s", "host", "delta")

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        timeout_s: float = 600.0,
        host: str | None = None,
        delta: bool = False,
    ) -> None:
        if bucket_size < 1:
            raise ConfigError(f"checkpoint engine bucket_size={bucket_size}: needs >= 1 byte")
        if not isinstance(delta, bool):
            raise ConfigError(f"checkpoint engine composable_gloo delta={delta!r}: true or false")
        self.wire_format = PATCHES if delta else NAMED_TENSORS
        #: The trainer's rank 0: the weights of the last sync (with ``delta``).
        self.base = DeltaExport() if delta else None
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.timeout = timedelta(seconds=timeout_s)
        self.host = host
        self.bucket: torch.Tensor | None = None
        self.store: Any = None
        self.group: Any = None
        self.rank: int | None = None

    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        host = self.host or _node_address()
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout
        )
        return {"host": host, "port": self.store.port}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        master = metadata[0] if metadata else {}
        if "port" not in master:
            raise RuntimeError(
                "gloo checkpoint engine: the trainer's rank 0 reported no store address "
                f"(metadata {metadata[:1]}); it is the one verl builds with is_master=True"
            )
        world = 1 + rollout_world_size
        actor: dict[str, list[Any]] = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world] * actor_wg_world_size,
            "master": [master] * actor_wg_world_size,
        }
        rollout: dict[str, list[Any]] = {
            "rank": list(range(1, world)),
            "world_size": [world] * rollout_world_size,
            "master": [master] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict[str, Any]) -> None:
        self.rank = rank
        if rank < 0:
            return
        store = self.store
        if rank != 0:
            store = dist.TCPStore(
                master["host"], master["port"], is_master=False, timeout=self.timeout
            )
        self.group = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        self.bucket = torch.empty(self.bucket_size, dtype=torch.uint8)

    def finalize(self) -> None:
        self.group = self.store = self.bucket = None
        self.rank = None

    @torch.no_grad()
    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> dict[str, float] | None:
        """Broadcast ``weights`` (every trainer rank walks them: their export is collective);
        with ``delta``, what changed since the last sync (see the module) and its metrics."""
        if self.rank is None:
            raise RuntimeError("gloo checkpoint engine: send_weights before init_process_group")
        if self.rank < 0:
            for _ in weights:
                pass
            return None
        assert self.bucket is not None
        payload = _Payload(_contiguous(weights), self.base)
        bucket_meta: dict[str, Any] = {}
        offset = 0
        async for meta, chunk in split_weight_chunks(payload.entries(), self.bucket_size):
            if offset + meta.chunk_size > self.bucket_size:
                self._broadcast_bucket(bucket_meta, offset, last=False)
                bucket_meta, offset = {}, 0
            meta.offset = offset
            bucket_meta[meta.name] = meta
            self.bucket[offset : offset + meta.chunk_size] = chunk
            offset += meta.chunk_size
        self._broadcast_bucket(bucket_meta, offset, last=True)
        return payload.metrics() if self.base is not None else None

    def _broadcast_bucket(self, bucket_meta: dict[str, Any], length: int, last: bool) -> None:
        assert self.bucket is not None
        header = pickle.dumps({"bucket_meta": bucket_meta, "length": length, "is_last": last})
        size = torch.tensor([len(header)], dtype=torch.int64)
        self._broadcast(size)
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if length:
            self._broadcast(self.bucket[:length])

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast([tensor], dist.BroadcastOptions()).wait()

    @torch.no_grad()
    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncGenerator[tuple[str, torch.Tensor | WeightPatch], None]:
        """The weights rank 0 sends, each whole (or, with ``delta``, as a patch), in the order
        it sent them."""
        positions = None
        async for name, tensor in merge_weight_chunks(self._chunks(), self.bucket_size):
            if name.endswith(_POSITIONS):
                positions = tensor
            elif name.endswith(_VALUES):
                assert positions is not None, f"{name!r} came without its positions"
                yield name.removesuffix(_VALUES), WeightPatch(positions, tensor)
                positions = None
            elif name.endswith(_WHOLE):
                yield name.removesuffix(_WHOLE), WeightPatch(None, tensor)
            else:
                yield name, tensor

    async def _chunks(self) -> AsyncIterator[tuple[Any, torch.Tensor]]:
        if self.rank is None or self.rank < 1:
            raise RuntimeError(
                f"gloo checkpoint engine: rank {self.rank} cannot receive (a rollout worker's "
                "rank is 1 or more, after init_process_group)"
            )
        assert self.bucket is not None
        while True:
            size = torch.zeros(1, dtype=torch.int64)
            self._broadcast(size)
            header = torch.empty(int(size), dtype=torch.uint8)
            self._broadcast(header)
            received = pickle.loads(header.numpy().tobytes())
            if received["length"]:
                self._broadcast(self.bucket[: received["length"]])
            for meta in received["bucket_meta"].values():
                # a copy: the bucket is overwritten by the next one
                yield meta, self.bucket[meta.offset : meta.offset + meta.chunk_size].clone()
            if received["is_last"]:
                return


class _Payload:
    """What one sync sends of ``weights``: each tensor whole, or with a ``base``
    (:class:`DeltaExport`) holding these tensors, each one's changed elements (positions, values)
    as two tensors; the bytes and elements counted for :meth:`metrics`."""

    def __init__(
        self, weights: Iterator[tuple[str, torch.Tensor]], base: DeltaExport | None
    ) -> None:
        self.weights, self.base = weights, base
        self.nbytes = self.elements = self.changed = 0

    def entries(self) -> Iterator[tuple[str, torch.Tensor]]:
        first = next(self.weights, None)
        if first is None:
            return
        weights = itertools.chain([first], self.weights)
        name = first[0]
        if self.base is None or name.startswith(PEFT_PREFIX):  # adapters alone: small, whole
            yield from self._whole(weights)
        elif self.base.names[:1] == [name]:
            yield from self._patches(weights)
        else:  # the first sync, or other tensors than the base's: whole, and the new base
            blocks = self.base.priming(HfBlock.whole(n, t) for n, t in self._whole(weights))
            yield from ((block.name, block.tensor) for block in blocks)

    def _whole(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            self.nbytes += tensor.nbytes
            self.elements += tensor.numel()
            self.changed += tensor.numel()
            yield name, tensor

    def _patches(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.base is not None
        for name, tensor in weights:
            (delta,) = self.base.deltas([HfBlock.whole(name, tensor)])
            self.elements += tensor.numel()
            self.changed += delta.values.numel()
            if not delta.values.numel():
                continue
            small = tensor.numel() < 2**31
            positions = delta.positions.to(torch.int32 if small else torch.int64)
            if positions.nbytes + delta.values.nbytes >= tensor.nbytes:  # whole is smaller
                self.nbytes += tensor.nbytes
                yield name + _WHOLE, tensor
                continue
            self.nbytes += positions.nbytes + delta.values.nbytes
            yield name + _POSITIONS, positions
            yield name + _VALUES, delta.values

    def metrics(self) -> dict[str, float]:
        return {
            "checkpoint_engine/payload_mbytes": self.nbytes / (1 << 20),
            "checkpoint_engine/changed_ratio": self.changed / max(self.elements, 1),
        }


def _contiguous(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor contiguous on the host (chunks are views of its bytes)."""
    for name, tensor in weights:
        yield name, tensor.detach().to("cpu").contiguous()


def _node_address() -> str:
    """This node's address as Ray knows it, else the loopback (one host)."""
    import ray

    if ray.is_initialized():
        return str(ray.util.get_node_ip_address()).strip("[]")
    return "127.0.0.1"
