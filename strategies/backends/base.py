"""The Backend protocol: how a model is parallelised, built and stepped; and the optional
abilities a backend may declare beside it.

``Backend`` is what every backend must do. An optional ability (checkpoints, Hugging Face
export, offload, packing) is a small Protocol here, checked with ``isinstance`` (:func:`require`): a
backend has it by implementing its methods, and asking for one a backend lacks is a
``ConfigError`` naming both. A backend also declares its ``kind`` (e.g. ``"megatron"``), which
subclasses and wrappers inherit: device platforms choose what they contribute by kind, never by
the registry name.

A backend knows heads only through ``heads.base.Head`` (the output spec it builds the last
layer from) and platforms only through what the Engine hands it (the torch device). The Engine
fixes the call order: ``validate`` -> ``init_mesh`` -> ``build_model`` -> ``build_optimizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch

from heads.base import Head, HeadContext
from heads.errors import ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist

    from strategies.checkpoint_files.publish import FileChecksums
    from strategies.hf.shards import ParamShard
    from strategies.memory.model_size import ParameterCount, RankMemory
    from strategies.part_configs import ParallelConfig, PartsConfig


class MicroBatch(Protocol):
    """What a backend reads of a micro-batch (structural: no upward import).

    The Engine's ``engine.data.batching.MicroBatch`` fits: sequences ``indices`` of the batch
    with the model's ``input_ids`` either right-padded to the micro-batch's own longest sequence,
    ``[b, s]`` (``cu_seqlens`` None), or packed back to back in one row ``[1, T]`` with each
    sequence's offset in ``cu_seqlens`` (``[b + 1]``; only for backends with :class:`Packing`);
    and the boolean ``attention_mask`` of the real tokens of the right-padded layout, ``[b, s]``.
    """

    @property
    def indices(self) -> torch.Tensor: ...
    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def attention_mask(self) -> torch.Tensor: ...
    @property
    def cu_seqlens(self) -> torch.Tensor | None: ...
    @property
    def routed_experts(self) -> torch.Tensor | None:
        """Routes to force (router replay), right-padded ``[b, s, moe_layers, top_k]``."""
        ...

    def unpack(self, row: torch.Tensor) -> torch.Tensor:
        """A packed per-token result ``[1, T, ...]`` -> right-padded ``[b, s, ...]``."""
        ...


class Step(Protocol):
    """What a backend reads of one prepared step (structural: the Engine's
    ``engine.step.Step`` fits): its micro-batches, and its real tokens summed over the
    data-parallel ranks (counted once, by the Engine)."""

    @property
    def micro_batches(self) -> Sequence[MicroBatch]: ...
    @property
    def global_tokens(self) -> float: ...


#: Called by the backend with each micro-batch's index and raw model output, on the ranks that
#: hold outputs; returns the loss to back-propagate and metrics for that micro-batch.
MicroBatchConsumer = Callable[[int, torch.Tensor, HeadContext], tuple[torch.Tensor, dict[str, Any]]]


@runtime_checkable
class Backend(Protocol):
    """A training backend. Built-in: ``strategies.backends.megatron.MegatronBackend`` and
    ``strategies.backends.fsdp2.Fsdp2Backend``."""

    #: Registry name of the built-in (a subclass registered under another name keeps it).
    name: ClassVar[str]
    #: What the backend is, for the parts that adapt to it (device platforms' mesh-init
    #: steps): inherited by subclasses, declared by wrappers.
    kind: ClassVar[str]

    def required_capabilities(self, config: PartsConfig) -> frozenset[str]:
        """Platform capabilities this config needs (e.g. ``sequence_parallel``)."""
        ...

    def validate(self, config: PartsConfig, world_size: int) -> None:
        """Reject a config this backend cannot run, naming the field, before any process
        group is touched."""
        ...

    def init_mesh(self, parallel: ParallelConfig) -> None: ...

    def build_model(self, config: PartsConfig, head: Head, device: torch.device) -> None: ...

    def build_optimizer(self, config: PartsConfig, *, memory_is_host: bool) -> None:
        """``memory_is_host``: the platform's device memory is the host's
        (``DevicePlatform.memory_is_host``), where host-memory optimizer settings change
        nothing."""
        ...

    def forward_backward(self, step: Step, consume: MicroBatchConsumer, forward_only: bool) -> None:
        """Run every micro-batch of ``step`` through the model (and backward unless
        ``forward_only``)."""
        ...

    def train(self) -> None: ...
    def eval(self) -> None: ...
    def optimizer_zero_grad(self) -> None: ...
    def grad_norm(self) -> float:
        """The global norm of the accumulated gradients, before clipping (collective over every
        rank of the model); changes no weights. The Engine steps only when it is finite."""
        ...

    def optimizer_step(self, grad_norm: float) -> None:
        """Clip the gradients by ``grad_norm`` (what ``grad_norm()`` measured of these very
        gradients, finite) and apply them; the norm is not measured again."""
        ...

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule one step; return the new learning rate."""
        ...

    def current_lr(self) -> float: ...
    def data_parallel_rank(self) -> int: ...
    def data_parallel_size(self) -> int: ...
    def data_parallel_group(self) -> dist.ProcessGroup | None: ...
    def holds_outputs(self) -> bool:
        """Whether this rank receives the model's outputs (the others get none); with model
        parallelism, one rank per data-parallel replica."""
        ...

    def modules(self) -> list[torch.nn.Module]:
        """The model chunks this rank holds (the unwrapped modules)."""
        ...


@runtime_checkable
class Checkpointing(Protocol):
    """Ability: save and restore the model, optimizer, LR schedule and RNG states."""

    def save_state(self, directory: str) -> FileChecksums | None:
        """Write this rank's part of the state into ``directory`` (collective). May return the
        size and checksum of files it checksummed while writing them (paths relative to
        ``directory``), which spares reading them back; the others are read back."""
        ...

    def load_state(self, directory: str, *, same_layout: bool) -> None:
        """Restore ``save_state``'s directory, resharded to this layout (collective); RNG
        states only when ``same_layout``. The optimizer and LR schedule take their state from
        it (moments, step counts) but keep this engine's settings
        (``strategies.checkpoint_files.resume_settings``)."""
        ...


class StagedSave(Protocol):
    """A save whose collective part is done and whose state is copied out of the model and
    optimizer: what is left only writes files, so it may run in a background thread while
    training goes on."""

    def write(self) -> tuple[FileChecksums, Any]:
        """Write this rank's files (no collectives). Returns the size and checksum of those it
        checksummed while writing, and what :meth:`finish` needs from this rank (picklable:
        it may travel between processes through a file)."""
        ...

    def finish(self, parts: Sequence[Any]) -> None:
        """On rank 0 after every rank's ``write``, given each rank's part in rank order: write
        what needs them all (e.g. the index of where each tensor went). No collectives."""
        ...


@runtime_checkable
class AsyncCheckpointing(Checkpointing, Protocol):
    """Ability: a save that blocks only while the state is staged (``save_checkpoint(...,
    async_save=True)``)."""

    def stage_state(self, directory: str) -> StagedSave:
        """Everything of ``save_state`` that needs the other ranks or the live state
        (collective), the rest left to the returned :class:`StagedSave`."""
        ...


@runtime_checkable
class HuggingFaceExport(Protocol):
    """Ability: the weights under Hugging Face names (e.g. for a rollout engine)."""

    def export_hf(self, config: PartsConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weights as (Hugging Face name, full tensor), one at a time."""
        ...

    def save_hf(self, config: PartsConfig, directory: str) -> None:
        """Write a Hugging Face checkpoint (collective): a causal LM, or for a value or reward
        head a token or sequence classifier (``strategies.hf.classification``)."""
        ...


@runtime_checkable
class ShardedExport(Protocol):
    """Ability: the ``export_hf`` (and ``export_adapter``) tensors as each rank's shards of
    them, nothing gathered: what a receiver rebuilds block by block, or diffs against the
    previous sync (``strategies.hf.shards``)."""

    def hf_param_shards(self, config: PartsConfig, *, adapter_only: bool) -> Iterator[ParamShard]:
        """This rank's parameters as shards of the Hugging Face tensors ``export_hf`` yields
        for ``config`` without LoRA (``adapter_only``: those of ``export_adapter``); no
        collectives, nothing copied."""
        ...


@runtime_checkable
class Offloading(Protocol):
    """Ability: move the model, optimizer state or gradients to host memory and back."""

    def offload(self, parts: Iterable[str]) -> None:
        """Move ``parts`` (of :data:`OFFLOAD_PARTS`) to host memory."""
        ...

    def reload(self, parts: Iterable[str]) -> None:
        """Bring offloaded ``parts`` back onto the device."""
        ...

    def offloaded(self) -> frozenset[str]: ...

    def weights_in_host_memory(self) -> bool:
        """The weights live in host memory whatever the device (they are computed with on it
        unit by unit): offloading the model moves nothing."""
        ...


@runtime_checkable
class Packing(Protocol):
    """Runs packed micro-batches: each one row holding its sequences back to back
    (``MicroBatch.cu_seqlens``), attention never crossing a sequence boundary, positions
    restarting at each sequence; the raw output it hands over covers the row's real tokens."""

    def check_packing(self, config: PartsConfig) -> None:
        """ConfigError when this configuration cannot run packed micro-batches (called before
        anything is built)."""
        ...

    def packed_micro_batch_multiple(self, config: PartsConfig) -> int:
        """The number of packed micro-batches in a batch must be a multiple of this (1: any
        number); the engine's token-budget planner rounds its count up to it."""
        ...


@runtime_checkable
class RouterReplay(Protocol):
    """Ability: mixture-of-experts router replay (``EngineConfig.router_replay``): every
    forward records the experts each token went to, and a micro-batch carrying
    ``routed_experts`` is routed exactly that way, each forced expert weighted by the live
    router scores."""

    def check_router_replay(self, config: PartsConfig) -> None:
        """ConfigError when this configuration cannot replay routes (before any build)."""
        ...

    def recorded_routes(self, step: Step) -> list[torch.Tensor]:
        """The routes ``forward_backward`` recorded running ``step``, per micro-batch, right-padded
        ``[b, s, moe_layers, top_k]`` int64 (collective over the model-parallel ranks; what
        ranks that hold no outputs get is unspecified)."""
        ...


@runtime_checkable
class RouterStatistics(Protocol):
    """Ability: per mixture-of-experts layer statistics of the last training step."""

    def router_statistics(self, step: Step) -> dict[str, float]:
        """Metrics per MoE layer of ``step``, the last one run (e.g. aux loss, load balance);
        empty for a dense model (collective over the model-parallel ranks)."""
        ...


@runtime_checkable
class DeferredGradNorm(Protocol):
    """Ability: the gradient norm measured without waiting for the device, so that the engine
    fetches it together with the step's other numbers (one device-to-host transfer a step)."""

    def grad_norm_parts(self) -> tuple[list[torch.Tensor], Callable[[list[float]], float]]:
        """Prepare the gradients as ``grad_norm`` does and return one-element device tensors
        (already reduced over the ranks that hold gradients) and the function that turns their
        host values into exactly what ``grad_norm`` returns. Collective where ``grad_norm`` is."""
        ...


@runtime_checkable
class MemoryEstimate(Protocol):
    """Ability: what one rank holds of the model at the peak of its build and training state,
    so that the engine refuses a model too large for the device before allocating any of it."""

    def memory_per_rank(
        self, config: PartsConfig, count: ParameterCount, world_size: int
    ) -> RankMemory:
        """The parameters and bytes one rank needs of the model ``count`` describes, laid out
        as ``config`` says over ``world_size`` ranks (no collectives, nothing allocated)."""
        ...


@runtime_checkable
class LowRankAdapters(Protocol):
    """Ability: LoRA (``EngineConfig.lora``): adapters on the attention and MLP linears, the
    only trained parameters besides the output layer of a head whose output is not the
    vocabulary (a value or reward head's new layer trains whole); switched off, the adapters
    add nothing (the base model exactly, under that head layer)."""

    def check_lora(self, config: PartsConfig) -> None:
        """ConfigError when this configuration cannot have adapters (before any build)."""
        ...

    def set_adapters_enabled(self, enabled: bool) -> None: ...
    def adapters_enabled(self) -> bool: ...
    def export_adapter(self, config: PartsConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's adapter tensors as (Hugging Face name as peft names it, without its
        ``base_model.model.`` prefix, full tensor), one at a time (collective like
        ``export_hf``); then, where this rank holds a trained head layer (a non-vocabulary
        head's), its tensors under their ``export_hf`` names (``score.weight``)."""
        ...


#: Refuses a training framework's setting the backend cannot honour, with the config it is
#: in, its name, its value and what to do instead (``(kind, setting, value, hint)``): what a
#: backend's translation of the framework's settings reports to (verl's ``Refusals.add``).
Refuse = Callable[[str, str, Any, str], None]

#: What ``Offloading`` moves: the names ``Engine.to`` and ``OffloadConfig`` use.
OFFLOAD_PARTS = ("model", "optimizer", "grad")

#: Every optional ability, by the name errors and ``python -m engine matrix`` show.
ABILITIES: dict[str, type] = {
    "checkpoints": Checkpointing,
    "async_checkpoints": AsyncCheckpointing,
    "huggingface_export": HuggingFaceExport,
    "sharded_export": ShardedExport,
    "offload": Offloading,
    "packing": Packing,
    "router_replay": RouterReplay,
    "router_statistics": RouterStatistics,
    "lora": LowRankAdapters,
}


def abilities(backend: object) -> list[str]:
    """The names of the optional abilities ``backend`` has."""
    return [name for name, protocol in ABILITIES.items() if isinstance(backend, protocol)]


A = TypeVar("A")


def require(backend: Backend, ability: type[A]) -> A:
    """``backend`` as ``ability`` (a Protocol of :data:`ABILITIES`); ConfigError if it lacks it."""
    if isinstance(backend, ability):
        return backend
    name = next(
        (key for key, protocol in ABILITIES.items() if protocol is ability), ability.__name__
    )
    offered = ", ".join(abilities(backend)) or "none"
    raise ConfigError(
        f"the {backend.name} backend lacks the {name!r} ability ({ability.__name__}); "
        f"its abilities: {offered}"
    )
