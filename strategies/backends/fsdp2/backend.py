"""The FSDP2 backend: a Hugging Face causal LM, ``fully_shard``-ed over every rank (data
parallel only), AdamW, megatron's LR schedule, DCP checkpoints.

Mixture-of-experts models run through transformers' own MoE modules (Qwen3-MoE, Mixtral):
every rank holds every expert's shard (no expert parallelism), routing is not replayed, and
transformers' body model returns no load-balancing loss, so none enters the loss.

Packed micro-batches (``EngineConfig.packing``) run as one row whose positions restart at each
sequence and whose attention stays inside each sequence (``fsdp2.attention``); the row holds
real tokens only, so a mixture of experts routes no padding.

torch's FSDP, DCP and transformers are imported inside functions, so listing or constructing the
backend is cheap.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, cast

import attrs
import torch
import torch.distributed as dist
from typing_extensions import override

from heads.base import Head, HeadContext, SequenceSplit
from heads.errors import ConfigError, EngineStateError
from heads.validation import bool_field, int_field, one_of
from strategies.backends.base import MicroBatchConsumer, Refuse, StagedSave, Step
from strategies.backends.fsdp2 import sharding
from strategies.backends.fsdp2.attention import PACKED_BOUNDS
from strategies.backends.fsdp2.model import CausalModel, build_causal_model
from strategies.backends.fsdp2.optimizer import (
    LRSchedule,
    build_optimizer,
    clip_gradients,
    gradient_norm,
    gradient_norm_tensor,
)
from strategies.backends.fsdp2.ulysses import check_heads, sequence_groups
from strategies.backends.shared import BackendState
from strategies.checkpoint_files.publish import FileChecksums
from strategies.hf.architecture import hf_config_for
from strategies.hf.classification import HeadLayer, head_layer
from strategies.hf.shards import ParamShard
from strategies.memory.model_size import DTYPE_BYTES, ParameterCount, RankMemory, training_state
from strategies.model.row_layout import RowLayout, row_layouts
from strategies.part_configs import DTYPE_NAMES, ParallelConfig, PartsConfig

#: Parallel settings this backend has no use for, and the value it runs them at.
_MODEL_PARALLEL_FIELDS = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "virtual_pipeline_parallel_size": None,
    "context_parallel_size": 1,
    "expert_parallel_size": 1,
    "sequence_parallel": False,
}


@attrs.define(kw_only=True)
class Fsdp2Backend(BackendState[torch.optim.AdamW]):
    """PyTorch FSDP2 (``fully_shard``) over Hugging Face transformers models."""

    name: ClassVar[str] = "fsdp2"
    kind: ClassVar[str] = "fsdp2"

    #: HSDP: replicate the sharded model over this many groups of ranks, each group sharding
    #: it (1: plain FSDP, every rank holds a shard of one copy).
    replicate_size: int = int_field(1)
    #: Recompute each decoder layer's activations in backward instead of keeping them.
    activation_checkpointing: bool = bool_field(False)
    #: Free each decoder layer's gathered parameters after its forward (gathered again for
    #: backward): less memory, one more all-gather per layer.
    reshard_after_forward: bool = bool_field(True)
    #: transformers' attention implementation.
    attention: str = attrs.field(default="sdpa", validator=one_of("sdpa", "eager"))
    #: Ulysses sequence parallelism: each sequence split over this many consecutive ranks, which
    #: exchange heads for sequence around attention (``fsdp2.ulysses``); data parallel over the
    #: world divided by it.
    ulysses_size: int = int_field(1)
    #: The dtype the weights are held in, and stepped in by AdamW (with its gradients and
    #: moments): float32, or bfloat16 for half the memory (no float32 master copy; compute in
    #: ``EngineConfig.dtype``).
    weights_dtype: str = attrs.field(default="float32", validator=one_of("float32", "bfloat16"))
    #: FSDP2's CPU offload policy: the sharded weights, their gradients and the optimizer step
    #: stay in host memory; each unit's weights are copied to the device for its compute.
    cpu_offload: bool = bool_field(False)

    _model: CausalModel | None = attrs.field(default=None, init=False)
    _schedule: LRSchedule | None = attrs.field(default=None, init=False)
    _clip_grad: float = attrs.field(default=0.0, init=False)
    _device: torch.device = attrs.field(factory=lambda: torch.device("cpu"), init=False)
    #: The head applies the output layer itself (``OutputSpec.fused``).
    _fused: bool = attrs.field(default=False, init=False)
    #: The head's output layer: its bias, where its weights come from, what save_hf writes.
    _head_layer: HeadLayer | None = attrs.field(default=None, init=False)
    #: Host copies of the state an asynchronous save writes, reused by the next one.
    _staging_buffers: dict[Any, torch.Tensor] = attrs.field(factory=dict, init=False)
    #: Ulysses: this rank's sequence-parallel and data-parallel groups (None without it).
    _sequence_group: dist.ProcessGroup | None = attrs.field(default=None, init=False)
    _data_group: dist.ProcessGroup | None = attrs.field(default=None, init=False)

    # -- verl's settings -----------------------------------------------------------------------
    @classmethod
    def verl_compute_dtype(cls, engine: Mapping[str, Any]) -> tuple[str, Any]:
        """The verl setting that gives the compute dtype, and its value: FSDP's
        ``mixed_precision.param_dtype`` (verl's default bf16), else the engine's ``dtype``."""
        if engine.get("mixed_precision") is not None:
            return "mixed_precision.param_dtype", engine["mixed_precision"].get(
                "param_dtype", "bf16"
            )
        if engine.get("model_dtype") is not None:
            return "mixed_precision.param_dtype", "bf16"  # verl's FSDP default
        return "dtype", engine.get("dtype", "bfloat16")

    @classmethod
    def options_from_verl(
        cls,
        model: Mapping[str, Any],
        engine: Mapping[str, Any],
        optimizer_settings: Sequence[tuple[str, str, Any]],
        world_size: int,
        refuse: Refuse,
    ) -> dict[str, Any]:
        """This backend's options from verl's model and FSDP engine config fields: ``fsdp_size``
        as ``replicate_size``, Ulysses, ``model_dtype`` as ``weights_dtype`` (float32 by
        default, bf16 for a forward-only engine when unset) and ``cpu_offload``, which verl's
        FSDP2 engines turn on with ``offload_policy`` and always for a forward-only engine (the
        reference). ``optimizer_settings`` (verl's setting, key, value) are all refused: this
        AdamW has none."""
        options: dict[str, Any] = {
            "activation_checkpointing": bool(model.get("enable_gradient_checkpointing", False)),
            "reshard_after_forward": bool(engine.get("reshard_after_forward", True)),
        }
        fsdp_size = engine.get("fsdp_size", -1)
        if fsdp_size not in (-1, None, world_size):
            if fsdp_size <= 0 or world_size % fsdp_size:
                refuse(
                    "engine", "fsdp_size", fsdp_size, f"must divide the world size ({world_size})"
                )
            else:
                options["replicate_size"] = world_size // fsdp_size
        ulysses = int(engine.get("ulysses_sequence_parallel_size", 1) or 1)
        if ulysses > 1:
            options["ulysses_size"] = ulysses
        forward_only = bool(engine.get("forward_only", False))
        weights = engine.get("model_dtype", "fp32")
        if weights is None:
            weights = "bf16" if forward_only else "fp32"
        if str(weights) not in DTYPE_NAMES:
            refuse("engine", "model_dtype", weights, "fp32 or bf16")
        options["weights_dtype"] = DTYPE_NAMES.get(str(weights), "float32")
        options["cpu_offload"] = bool(engine.get("offload_policy", False)) or forward_only
        for setting, _, value in optimizer_settings:
            refuse("optimizer", setting, value, "megatron's optimizer settings only")
        return options

    # -- checks --------------------------------------------------------------------------------
    def required_capabilities(self, config: PartsConfig) -> frozenset[str]:
        return frozenset()

    def validate(self, config: PartsConfig, world_size: int) -> None:
        for field, neutral in _MODEL_PARALLEL_FIELDS.items():
            value = getattr(config.parallel, field)
            if value != neutral:
                raise ConfigError(
                    f"ParallelConfig.{field}={value}: the fsdp2 backend shards data-parallel "
                    f"only (it needs {neutral}); use the megatron backend for model parallelism"
                )
        check_torch_version()
        self._check_replicate_size(world_size)
        self._check_ulysses(config, world_size)
        if config.model.max_sequence_length <= 1:
            raise ConfigError("ModelConfig.max_sequence_length must be > 1")
        for field in ("router_aux_loss_coeff", "router_z_loss_coeff"):
            if getattr(config.model, field):
                raise ConfigError(
                    f"ModelConfig.{field}={getattr(config.model, field)}: the fsdp2 backend's "
                    "transformers MoE modules compute no router loss; set it to 0, or use the "
                    "megatron backend"
                )
        # the model must map onto a transformers architecture (a mixture of experts: softmax
        # routing, no shared experts)
        hf_config_for(config.model)

    def memory_per_rank(
        self, config: PartsConfig, count: ParameterCount, world_size: int
    ) -> RankMemory:
        """The larger of the build's peak, the whole model's weights on every rank
        (``build_causal_model`` materialises them before ``fully_shard`` splits them), and the
        rank's shard once trained: weights (the master ones under bfloat16 compute), gradients
        and AdamW's moments, in ``weights_dtype`` (counted as float32: an upper bound)."""
        whole = count.total
        weight = DTYPE_BYTES[self.weights_dtype]
        built = whole * weight
        shards = max(world_size // self.replicate_size, 1)
        trained, what = training_state(config)
        shard = -(-whole // shards)
        sharded = int(shard * (weight + trained))
        if built >= sharded:
            return RankMemory(
                parameters=whole,
                bytes=built,
                counted=f"{self.weights_dtype} weights of the whole model, which the fsdp2 "
                "backend builds on every rank before sharding it",
            )
        part = f" of its 1/{shards} shard" if shards > 1 else ""
        return RankMemory(
            parameters=shard, bytes=sharded, counted=f"{self.weights_dtype} weights{what}{part}"
        )

    # -- lifecycle -----------------------------------------------------------------------------
    def init_mesh(self, parallel: ParallelConfig) -> None:
        """Data parallel over the default process group; the device mesh itself is made with
        the model, on its device type."""
        if not dist.is_initialized():
            raise EngineStateError("the fsdp2 backend needs the default process group first")
        self._check_replicate_size(dist.get_world_size())
        if self.ulysses_size > 1:
            self._sequence_group, self._data_group = sequence_groups(self.ulysses_size)

    def _check_ulysses(self, config: PartsConfig, world_size: int) -> None:
        size = self.ulysses_size
        if size == 1:
            return
        if world_size % size:
            raise ConfigError(
                f"Fsdp2Backend.ulysses_size ({size}) must divide the world size {world_size}"
            )
        model = config.model
        why = check_heads(
            model.num_attention_heads, model.num_query_groups or model.num_attention_heads, size
        )
        if why is not None:
            raise ConfigError(f"ModelConfig.{why}")
        if self.attention != "sdpa":
            raise ConfigError(
                f"Fsdp2Backend.ulysses_size={size} needs attention='sdpa' (its attention "
                f"exchanges heads for sequence), not {self.attention!r}"
            )

    def _check_replicate_size(self, world_size: int) -> None:
        if world_size % self.replicate_size:
            raise ConfigError(
                f"Fsdp2Backend.replicate_size ({self.replicate_size}) must divide the world "
                f"size {world_size}"
            )

    def build_model(self, config: PartsConfig, head: Head, device: torch.device) -> None:
        self._device = device
        spec = head.output_spec()
        self._fused = spec.fused
        self._head_layer = head_layer(config.model, head)
        model = build_causal_model(
            config,
            spec,
            self._head_layer,
            device,
            self.attention,
            weights_dtype=getattr(torch, self.weights_dtype),
        )
        if config.lora is not None:
            from strategies.backends.fsdp2.lora import attach_adapters

            attach_adapters(model, config, self._adapter_switch)
        if self.activation_checkpointing:
            model.model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        mesh = sharding.device_mesh(device.type, self.replicate_size)
        sharding.shard_model(
            model,
            mesh,
            config.dtype,
            weights_dtype=self.weights_dtype,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
        )
        self._model = model

    def build_optimizer(self, config: PartsConfig, *, memory_is_host: bool) -> None:
        model = self._require_model()
        self._optimizer = build_optimizer(config, model)
        self._schedule = LRSchedule.from_config(config, self._optimizer)
        self._clip_grad = config.optimizer.clip_grad

    # -- steps ---------------------------------------------------------------------------------
    def forward_backward(self, step: Step, consume: MicroBatchConsumer, forward_only: bool) -> None:
        """Each micro-batch forward (and backward); gradients accumulate locally and are
        reduce-scattered once, in the last micro-batch's backward."""
        model = self._require_model()
        micro_batches = step.micro_batches
        last = len(micro_batches) - 1
        head_context = HeadContext()
        group = self._sequence_group
        # Ulysses: rows of a multiple of its size
        rows = row_layouts(micro_batches, multiple=self.ulysses_size)
        try:
            for index, (micro_batch, row) in enumerate(zip(micro_batches, rows, strict=True)):
                input_ids = micro_batch.input_ids.to(
                    device=self._device, dtype=torch.long, non_blocking=True
                )
                inputs = self._layout(row)
                if group is not None:  # this rank's part of the rows (fsdp2.ulysses)
                    inputs["sequence_group"] = group
                    input_ids = self._own_part(
                        torch.nn.functional.pad(input_ids, (0, row.width - row.length))
                    )
                    for name in ("attention_mask", "position_ids"):
                        inputs[name] = self._own_part(inputs[name])
                split = None
                if group is not None:  # the head runs on this rank's part (heads.base)
                    every = torch.arange(row.width, device=self._device)[None]
                    split = row.split(self._own_part(every)[0], group)
                consume_whole = functools.partial(_consume_rows, consume, index, row, split)
                if not forward_only:
                    model.set_requires_gradient_sync(index == last)  # type: ignore[operator]
                if self._fused:  # the head applies the output layer, inside the model's forward
                    loss, _ = model(
                        input_ids,
                        **inputs,
                        fused_head=functools.partial(_consume_hidden, consume_whole, head_context),
                    )
                else:
                    loss, _ = consume_whole(model(input_ids, **inputs), head_context)
                if not forward_only:
                    # every rank of a sequence-parallel group computes the same loss: see ulysses
                    (loss if group is None else loss / self.ulysses_size).backward()
        except BaseException:
            if not forward_only:  # a failed step leaves no gradients behind for the next
                sharding.drop_unreduced_gradients(model)
            raise
        finally:
            if forward_only:
                # FSDP2 keeps the root's parameters (embedding, output layer, final norm)
                # gathered after a forward for the backward that follows; none follows here,
                # so they are sharded again: at rest a rank holds its shards only, as after a
                # training step (and code that reads the parameters at rest sees shards)
                for unit in sharding.fsdp_modules(model):
                    unit.reshard()

    def _layout(self, row: RowLayout) -> dict[str, Any]:
        """The model's attention mask, positions and attention keywords for a micro-batch laid
        out as ``row``: right-padded rows (positions from 0, no padding read), or one packed row
        (positions restarting at each sequence, and its segments, host ints, for the attention
        of ``packed_sdpa``; Ulysses' padding of the row is one more segment). Rows are
        right-padded and attention is causal, so no real token sees the padding after it: the
        mask is all ones (with none, transformers would look for packing in the positions,
        reading them on the host, and build a ``[T, T]`` mask), which ``packed_sdpa`` ignores."""
        device = self._device
        keywords: dict[str, Any] = {
            "attention_mask": torch.ones(row.rows, row.width, dtype=torch.bool, device=device),
            "position_ids": row.positions_on(device),
        }
        if row.packed:
            keywords[PACKED_BOUNDS] = row.bounds
        return keywords

    def _own_part(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous part of ``rows`` ``[b, width]`` (Ulysses)."""
        group = cast(dist.ProcessGroup, self._sequence_group)
        return rows.chunk(self.ulysses_size, dim=1)[dist.get_rank(group)]

    def check_packing(self, config: PartsConfig) -> None:
        """Packed rows need the attention of ``packed_sdpa`` (``attention="sdpa"``)."""
        if self.attention != "sdpa":
            raise ConfigError(
                f"Fsdp2Backend.attention={self.attention!r} cannot run packed micro-batches "
                "(EngineConfig.packing): use attention='sdpa', or turn packing off"
            )

    def packed_micro_batch_multiple(self, config: PartsConfig) -> int:
        """Any number of packed micro-batches (no pipeline schedule)."""
        return 1

    def train(self) -> None:
        self._require_model().train()

    def eval(self) -> None:
        self._require_model().eval()

    def optimizer_zero_grad(self) -> None:
        self._require_optimizer().zero_grad(set_to_none=True)

    def grad_norm(self) -> float:
        self._require_optimizer()
        return gradient_norm(self._require_model().parameters())

    def grad_norm_parts(self) -> tuple[list[torch.Tensor], Callable[[list[float]], float]]:
        self._require_optimizer()
        total = gradient_norm_tensor(self._require_model().parameters())
        if total is None:
            return [], lambda values: 0.0
        return [total], lambda values: values[0]

    def optimizer_step(self, grad_norm: float) -> None:
        optimizer = self._require_optimizer()
        clip_gradients(self._require_model().parameters(), self._clip_grad, grad_norm)
        optimizer.step()

    def lr_scheduler_step(self) -> float:
        self._require_optimizer()  # the schedule is built with it
        return cast(LRSchedule, self._schedule).step(1)

    def current_lr(self) -> float:
        return float(self._require_optimizer().param_groups[0]["lr"])

    # -- layout --------------------------------------------------------------------------------
    def data_parallel_rank(self) -> int:
        return dist.get_rank() // self.ulysses_size if dist.is_initialized() else 0

    def data_parallel_size(self) -> int:
        return dist.get_world_size() // self.ulysses_size if dist.is_initialized() else 1

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Every rank is a data-parallel rank: the default group (one process too, as
        megatron's data-parallel group of one), or with Ulysses the ranks at this rank's place
        in every sequence-parallel group; None only without a process group."""
        if self._data_group is not None:
            return self._data_group
        return dist.group.WORLD if dist.is_initialized() else None

    def holds_outputs(self) -> bool:
        """Every rank, or with Ulysses the first of each sequence-parallel group."""
        return self._sequence_group is None or dist.get_rank(self._sequence_group) == 0

    def modules(self) -> list[torch.nn.Module]:
        return [self._require_model()]

    # -- offload -------------------------------------------------------------------------------
    def weights_in_host_memory(self) -> bool:
        """With ``cpu_offload``: FSDP2's CPU offload policy keeps them there."""
        return self.cpu_offload

    def offload(self, parts: Iterable[str]) -> None:
        """Move ``parts`` (model, optimizer, grad) to host memory; their device storage is freed."""
        model = self._require_model()
        parts = list(parts)
        if "model" in parts:
            for unit in sharding.fsdp_modules(model):
                unit.reshard()  # gathered parameters are freed, not offloaded
        tensors = {"model": self._model_tensors, "grad": self._grad_tensors}
        if self._optimizer is not None:
            tensors["optimizer"] = self._optimizer_tensors
        self._offloaded.offload(parts, tensors)

    def _model_tensors(self) -> list[torch.Tensor]:
        """This rank's shards of the weights, and the buffers (RoPE frequencies)."""
        model = self._require_model()
        return [_local(p) for p in model.parameters()] + list(model.buffers())

    def _grad_tensors(self) -> list[torch.Tensor]:
        return [_local(p.grad) for p in self._require_model().parameters() if p.grad is not None]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """This rank's shards of the Adam moments."""
        states = self._require_optimizer().state.values()
        return [
            _local(value)
            for state in states
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim()
        ]

    # -- checkpoints and weights ---------------------------------------------------------------
    def save_state(self, directory: str) -> FileChecksums:
        """Model, optimizer, LR schedule and RNG states into ``directory`` (collective); the
        size and checksum of this rank's DCP file, checksummed as it was written."""
        from strategies.backends.fsdp2.checkpoint import save_state

        return save_state(self._require_model(), self._optimizer, self._schedule, directory)

    def stage_state(self, directory: str) -> StagedSave:
        """``save_state``'s collective part and a host copy of the state; the DCP files are left
        to the returned save (for ``save_checkpoint(..., async_save=True)``)."""
        from strategies.backends.fsdp2.checkpoint import stage_state

        return stage_state(
            self._require_model(),
            self._optimizer,
            self._schedule,
            directory,
            self._staging_buffers,
        )

    def load_state(self, directory: str, *, same_layout: bool) -> None:
        """Restore ``save_state``'s directory, resharded to this layout (collective)."""
        from strategies.backends.fsdp2.checkpoint import load_state

        load_state(
            self._require_model(),
            self._optimizer,
            self._schedule,
            directory,
            same_layout=same_layout,
        )

    def export_hf(self, config: PartsConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) pairs, one at a time (collective)."""
        from strategies.backends.fsdp2.export import export_hf

        return export_hf(self._require_model(), config.model, config.lora)

    def hf_param_shards(self, config: PartsConfig, *, adapter_only: bool) -> Iterator[ParamShard]:
        """This rank's parameters as shards of their Hugging Face tensors (see ``export``)."""
        from strategies.backends.fsdp2.export import param_shards

        return param_shards(self._require_model(), config.model, adapter_only=adapter_only)

    def save_hf(self, config: PartsConfig, directory: str) -> None:
        """Write a Hugging Face checkpoint of the model (collective: every rank calls it)."""
        from strategies.backends.fsdp2.export import save_hf

        model = self._require_model()
        assert self._head_layer is not None  # built with the model
        save_hf(model, config.model, self._head_layer, directory, config.lora)

    # -- LoRA ----------------------------------------------------------------------------------
    def check_lora(self, config: PartsConfig) -> None:
        """Dense models (transformers' fused experts get no adapters)."""
        from strategies.backends.fsdp2.lora import check_lora

        check_lora(config)

    def export_adapter(self, config: PartsConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters as (Hugging Face name, full tensor) pairs, one at a time (collective)."""
        from strategies.backends.fsdp2.export import export_adapter

        return export_adapter(self._require_model())

    def _require_model(self) -> CausalModel:
        if self._model is None:
            raise EngineStateError("the fsdp2 backend has no model yet: call build_model first")
        return self._model

    @override
    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(replicate_size={self.replicate_size}, "
            f"activation_checkpointing={self.activation_checkpointing})"
        )


#: The oldest torch whose FSDP2 has every call this backend makes (``fully_shard``'s
#: ``set_gradient_divide_factor`` and ``set_force_sum_reduction_for_comms``); tested with 2.13.
MIN_TORCH = "2.8"


def _consume_rows(
    consume: MicroBatchConsumer,
    index: int,
    row: RowLayout,
    split: SequenceSplit | None,
    raw: torch.Tensor,
    context: HeadContext,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``consume`` micro-batch ``index``'s raw output: with Ulysses, this rank's part of the
    rows as ``split`` says; else the rows cut back to the micro-batch's length."""
    if split is not None:
        return consume(index, raw, attrs.evolve(context, sequence_split=split))
    return consume(index, row.to_caller(raw), context)


def _consume_hidden(
    consume: Callable[[torch.Tensor, HeadContext], tuple[torch.Tensor, dict[str, Any]]],
    context: HeadContext,
    hidden: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``consume`` a micro-batch's final hidden states, with the output weight for the head.
    The loss is returned from the FSDP root's forward, which warns about a view (the loss
    function's may be one): a copy of the scalar."""
    loss, metrics = consume(hidden, attrs.evolve(context, output_weight=weight))
    return loss.clone(), metrics


def check_torch_version() -> None:
    from packaging.version import Version

    if Version(torch.__version__.split("+")[0]) < Version(MIN_TORCH):
        raise ConfigError(
            f"the fsdp2 backend needs torch >= {MIN_TORCH} (FSDP2's gradient-reduction "
            f"settings); this is torch {torch.__version__}"
        )


def _local(tensor: Any) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    local: torch.Tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local


__all__ = ["Fsdp2Backend"]
