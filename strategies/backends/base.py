"""The Backend protocol: how a model is parallelised, built and stepped.

A backend knows heads only through ``heads.base.Head`` (the output spec it builds the last
layer from) and platforms only through what the Engine hands it (the torch device). The Engine
fixes the call order: ``validate`` -> ``init_mesh`` -> ``build_model`` -> ``build_optimizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from heads.base import Head, HeadContext

if TYPE_CHECKING:
    import torch.distributed as dist

    from strategies.config import ParallelConfig, PartsConfig


class MicroBatch(Protocol):
    """What a backend reads of a micro-batch (structural: no upward import).

    The Engine's ``engine.data.batching.MicroBatch`` fits: sequences ``indices`` of the batch with
    their ``input_ids`` right-padded to the micro-batch's own longest sequence, ``[b, s]``.
    """

    @property
    def indices(self) -> torch.Tensor: ...
    @property
    def input_ids(self) -> torch.Tensor: ...


#: Called by the backend with each micro-batch's index and raw model output, on the ranks that
#: hold outputs; returns the loss to back-propagate and metrics for that micro-batch.
MicroBatchConsumer = Callable[[int, torch.Tensor, HeadContext], tuple[torch.Tensor, dict[str, Any]]]


@runtime_checkable
class Backend(Protocol):
    """A training backend. Built-in: ``strategies.backends.megatron.MegatronBackend``."""

    name: ClassVar[str]

    def required_capabilities(self, config: PartsConfig) -> frozenset[str]:
        """Platform capabilities this config needs (e.g. ``sequence_parallel``)."""
        ...

    def validate(self, config: PartsConfig, world_size: int) -> None:
        """Reject a config this backend cannot run, before any process group is touched."""
        ...

    def init_mesh(self, parallel: ParallelConfig) -> None: ...

    def build_model(self, config: PartsConfig, head: Head, device: torch.device) -> None: ...

    def build_optimizer(self, config: PartsConfig) -> None: ...

    def forward_backward(
        self, micro_batches: Sequence[MicroBatch], consume: MicroBatchConsumer, forward_only: bool
    ) -> None:
        """Run every micro-batch through the model (and backward unless ``forward_only``)."""
        ...

    def train(self) -> None: ...
    def eval(self) -> None: ...
    def optimizer_zero_grad(self) -> None: ...
    def grad_norm(self) -> float:
        """The global norm of the accumulated gradients, before clipping (collective over every
        rank of the model); changes no weights. The Engine steps only when it is finite."""
        ...

    def optimizer_step(self) -> float:
        """Clip and apply gradients; return the global gradient norm before clipping."""
        ...

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule one step; return the new learning rate."""
        ...

    def current_lr(self) -> float: ...
    def offload(self, parts: Iterable[str]) -> None:
        """Move ``parts`` (``model``, ``optimizer``, ``grad``) to host memory."""
        ...

    def reload(self, parts: Iterable[str]) -> None:
        """Bring offloaded ``parts`` back onto the device."""
        ...

    def offloaded(self) -> frozenset[str]: ...
    def data_parallel_rank(self) -> int: ...
    def data_parallel_size(self) -> int: ...
    def data_parallel_group(self) -> dist.ProcessGroup | None: ...
    def is_mp_src_rank_with_outputs(self) -> bool: ...
    def modules(self) -> list[torch.nn.Module]:
        """The model chunks this rank holds (the unwrapped modules)."""
        ...
