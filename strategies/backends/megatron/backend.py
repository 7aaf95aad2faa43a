"""The Megatron-core backend: mesh, GPTModel, megatron DDP + optimizer, forward-backward schedule.

megatron-core is imported inside methods only, so listing or constructing the backend is cheap.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from typing_extensions import override

from heads.base import Head, HeadContext
from heads.errors import BatchError, ConfigError, EngineStateError
from heads.validation import bool_field, of_type, one_of
from strategies.backends.base import MicroBatch, MicroBatchConsumer, Refuse, StagedSave, Step
from strategies.backends.megatron import mesh, state_tensors
from strategies.backends.megatron.model import (
    build_gpt_model,
    check_transformer_overrides,
    transformer_config,
    uses_transformer_engine,
)
from strategies.backends.megatron.moe_routers import Routing
from strategies.backends.megatron.optimizer import (
    OPTIMIZER_OVERRIDES,
    build_optimizer,
    build_scheduler,
    check_optimizer_overrides,
    grad_norm_parts,
    optimizer_overrides_on,
    step_with_grad_norm,
)
from strategies.backends.megatron.schedule_step import ForwardStep, step_layouts
from strategies.backends.shared import BackendState
from strategies.checkpoint_files.publish import FileChecksums
from strategies.hf.classification import HeadLayer, head_layer
from strategies.megatron_support.imports import import_megatron
from strategies.megatron_support.version import check_megatron_version
from strategies.memory.model_size import DTYPE_BYTES, ParameterCount, RankMemory, training_state
from strategies.model.row_layout import RowLayout
from strategies.part_configs import ModelConfig, ParallelConfig, PartsConfig

if TYPE_CHECKING:
    import torch.distributed as dist

    from strategies.hf.shards import ParamShard


#: The megatron-core modules (with what they import) that announce, on first import, a GPU
#: library they fall back from; ``validate`` imports them without the notices
#: (:mod:`strategies.megatron_support.imports`), so the methods' later imports find them loaded.
MEGATRON_MODULES = (
    "transformer.transformer_config", "models.gpt.gpt_layer_specs", "models.gpt.gpt_model",
    "optimizer", "distributed", "pipeline_parallel",
)  # fmt: skip


@attrs.define(kw_only=True)
class MegatronBackend(BackendState[Any]):
    """Megatron-core (GPTModel, local or TransformerEngine layer spec)."""

    name: ClassVar[str] = "megatron"
    kind: ClassVar[str] = "megatron"

    #: ``auto``: TransformerEngine's layer spec where it is installed, else megatron's local one.
    layer_spec: str = attrs.field(
        default="auto", validator=one_of("auto", "local", "transformer_engine")
    )
    overlap_grad_reduce: bool = bool_field(False)
    #: Shard the optimizer state over data-parallel ranks (megatron's distributed optimizer).
    use_distributed_optimizer: bool = bool_field(False)
    #: Extra megatron ``TransformerConfig`` fields (also handed to MindSpeed's repatch on NPU).
    transformer_overrides: dict[str, Any] = attrs.field(factory=dict, validator=of_type(dict))
    #: megatron ``OptimizerConfig`` fields (``optimizer.OPTIMIZER_OVERRIDES``): CPU optimizer
    #: offload and the precision-aware optimizer (both need ``use_distributed_optimizer``).
    optimizer_overrides: dict[str, Any] = attrs.field(factory=dict, validator=of_type(dict))
    #: Context parallelism's attention on the local layer spec (``context_parallel``):
    #: ``all_gather`` the keys and values of the whole row (SDPA's fused kernel), or ``ring``
    #: (they go round the ranks; nothing held whole, slower on a CPU). TransformerEngine's
    #: attention takes megatron's own ``cp_comm_type`` (``transformer_overrides``).
    context_parallel_attention: str = attrs.field(
        default="all_gather", validator=one_of("all_gather", "ring")
    )

    _chunks: list[torch.nn.Module] = attrs.field(factory=list, init=False)
    _wrapped: list[torch.nn.Module] = attrs.field(factory=list, init=False)
    _scheduler: Any = attrs.field(default=None, init=False)
    _device: torch.device = attrs.field(factory=lambda: torch.device("cpu"), init=False)
    _head_context: HeadContext = attrs.field(factory=HeadContext, init=False)
    #: The head applies the output layer itself (``OutputSpec.fused``).
    _fused: bool = attrs.field(default=False, init=False)
    #: The head's output layer: its bias, where its weights come from, what save_hf writes.
    _head_layer: HeadLayer | None = attrs.field(default=None, init=False)
    #: The core attention is this project's (the local layer spec): packed rows' offsets stay
    #: on the host and it reads the context-parallel layout (``context_parallel.row_params``).
    _local_attention: bool = attrs.field(default=False, init=False)
    #: The ranks each row is split over (context parallelism), or None.
    _context_group: Any = attrs.field(default=None, init=False)
    #: Host copies of the state an asynchronous save writes, reused by the next one.
    _staging_buffers: dict[Any, torch.Tensor] = attrs.field(factory=dict, init=False)
    _model: ModelConfig | None = attrs.field(default=None, init=False)
    #: Mixture-of-experts routers (load statistics, router replay); empty for a dense model.
    _routing: Routing = attrs.field(factory=lambda: Routing([], 0, 0), init=False)

    # -- verl's settings -----------------------------------------------------------------------
    @classmethod
    def verl_compute_dtype(cls, engine: Mapping[str, Any]) -> tuple[str, Any]:
        """The verl setting that gives the compute dtype, and its value: the engine's ``dtype``."""
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
        """This backend's options from verl's model and megatron engine config fields: the
        distributed optimizer, ``override_transformer_config`` (with full recompute for
        gradient checkpointing), and of ``optimizer_settings`` (verl's setting, key, value)
        the :data:`OPTIMIZER_OVERRIDES` fields as ``optimizer_overrides``, another refused."""
        ulysses = engine.get("ulysses_sequence_parallel_size", 1)
        if ulysses not in (None, 1):
            refuse(
                "engine",
                "ulysses_sequence_parallel_size",
                ulysses,
                "Ulysses is the fsdp strategies'; megatron splits sequences with "
                "context_parallel_size",
            )
        overrides = dict(engine.get("override_transformer_config") or {})
        if model.get("enable_gradient_checkpointing", False):
            overrides.setdefault("recompute_granularity", "full")
            overrides.setdefault("recompute_method", "uniform")
            overrides.setdefault("recompute_num_layers", 1)
        options: dict[str, Any] = {
            "use_distributed_optimizer": bool(engine.get("use_distributed_optimizer", False)),
            "transformer_overrides": overrides,
        }
        kept: dict[str, Any] = {}
        for setting, key, value in optimizer_settings:
            if key in OPTIMIZER_OVERRIDES:
                kept[key] = value
            else:
                refuse("optimizer", setting, value, f"one of {', '.join(OPTIMIZER_OVERRIDES)}")
        if kept:
            options["optimizer_overrides"] = kept
        return options

    # -- checks --------------------------------------------------------------------------------
    def required_capabilities(self, config: PartsConfig) -> frozenset[str]:
        parallel = config.parallel
        wanted = {"sequence_parallel"} if parallel.sequence_parallel else set()
        if parallel.context_parallel_size > 1:
            wanted.add("context_parallel")
        return frozenset(wanted)

    def validate(self, config: PartsConfig, world_size: int) -> None:
        check_megatron_version()
        import_megatron(*MEGATRON_MODULES)  # before any other import of megatron's
        parallel, model = config.parallel, config.model
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        mesh.check_world_size(parallel, world_size)
        for what, count in (
            ("num_attention_heads", model.num_attention_heads),
            ("num_query_groups", model.num_query_groups or model.num_attention_heads),
            ("vocab_size", model.vocab_size),
            ("ffn_hidden_size", model.resolved_ffn_hidden_size),
        ):
            if count % tp:
                raise ConfigError(
                    f"ModelConfig.{what} ({count}) must be divisible by tensor_parallel_size ({tp})"
                )
        stages = pp * (parallel.virtual_pipeline_parallel_size or 1)
        if model.num_layers % stages:
            raise ConfigError(
                f"ModelConfig.num_layers ({model.num_layers}) must be divisible by "
                f"pipeline_parallel_size x virtual stages ({stages})"
            )
        if parallel.virtual_pipeline_parallel_size is not None and pp == 1:
            raise ConfigError(
                "virtual_pipeline_parallel_size needs pipeline_parallel_size > 1 (it splits each "
                "pipeline stage into interleaved chunks)"
            )
        check_experts(config, world_size)
        if model.hf_path is not None:
            self._check_hf_experts(config)
        uses_transformer_engine(self.layer_spec)
        check_transformer_overrides(self.transformer_overrides)
        check_optimizer_overrides(self.optimizer_overrides, self.use_distributed_optimizer)
        if config.model.max_sequence_length <= 1:
            raise ConfigError("ModelConfig.max_sequence_length must be > 1")

    def memory_per_rank(
        self, config: PartsConfig, count: ParameterCount, world_size: int
    ) -> RankMemory:
        """A rank's share: the layers split over pipeline stages (the routed experts over
        expert-parallel ranks too), the embedding on the first stage and the output layer (a
        tied one's copy) on the last, all of it over tensor-parallel ranks; the distributed
        optimizer splits its state over the data-parallel ranks (context-parallel ones too)."""
        parallel = config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        embedding, output = count.embedding.parameters, count.output.parameters
        ends = embedding + output
        if pp > 1:
            ends = max(embedding, embedding if count.tied else output)
        experts = count.experts.parameters // parallel.expert_parallel_size
        parameters = (count.layers // pp + experts // pp + ends) // tp
        shards = max(world_size // (tp * pp), 1) if self.use_distributed_optimizer else 1
        bfloat16 = config.dtype == "bfloat16"
        trained, what = training_state(
            config, master_bytes=4 if bfloat16 else 0, optimizer_shards=shards
        )
        return RankMemory(
            parameters=parameters,
            bytes=int(parameters * (DTYPE_BYTES[config.dtype] + trained)),
            counted=f"{config.dtype} weights{what}; tensor_parallel_size={tp}, "
            f"pipeline_parallel_size={pp}",
        )

    # -- lifecycle -----------------------------------------------------------------------------
    def init_mesh(self, parallel: ParallelConfig) -> None:
        mesh.init_mesh(parallel)

    def build_model(self, config: PartsConfig, head: Head, device: torch.device) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.transformer.module import Float16Module

        self._device = device
        torch.manual_seed(config.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        spec = head.output_spec()
        self._fused = spec.fused
        self._head_layer = head_layer(config.model, head)
        self._local_attention = not uses_transformer_engine(self.layer_spec)
        if config.parallel.context_parallel_size > 1:
            self._context_group = ps.get_context_parallel_group()
        virtual_stages = config.parallel.virtual_pipeline_parallel_size
        self._chunks = []
        for vp_stage in range(virtual_stages or 1):
            stage = vp_stage if virtual_stages else None
            self._chunks.append(
                build_gpt_model(
                    config,
                    spec,
                    self._head_layer,
                    self.layer_spec,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                    vp_stage=stage,
                    overrides=self.transformer_overrides,
                ).to(device)
            )
        self._model = config.model
        parallel = config.parallel
        sequence_parallel = parallel.sequence_parallel and parallel.tensor_parallel_size > 1
        context_parallel = parallel.context_parallel_size > 1
        self._routing = Routing.attach(
            self._chunks,
            record=config.router_replay,
            sequence_group=ps.get_tensor_model_parallel_group() if sequence_parallel else None,
            split_group=(
                ps.get_tensor_and_context_parallel_group()
                if sequence_parallel and context_parallel
                else ps.get_tensor_model_parallel_group()
                if sequence_parallel
                else ps.get_context_parallel_group()
                if context_parallel
                else None
            ),
        )
        if config.model.hf_path is not None:
            from strategies.backends.megatron.hf.loading import load_hf_weights

            for chunk in self._chunks:
                load_hf_weights(chunk, config.model, self._head_layer)
        if config.lora is not None:
            from strategies.backends.megatron.lora import attach_adapters

            for chunk in self._chunks:
                attach_adapters(chunk, config, self._adapter_switch)
        wrapped: list[torch.nn.Module] = list(self._chunks)
        if config.dtype == "bfloat16":
            wrapped = [Float16Module(chunk.config, chunk) for chunk in self._chunks]
        if not config.forward_only:
            wrapped = self._wrap_ddp(config, wrapped)
        self._wrapped = wrapped
        if config.forward_only:  # a reference model never trains (megatron's MoE layer under
            self.eval()  # tensor parallelism refuses training mode without sequence parallel)
        tp = ps.get_tensor_model_parallel_world_size()
        if spec.kind == "vocab" and tp > 1:
            shard = config.model.vocab_size // tp
            self._head_context = HeadContext(
                tensor_parallel_group=ps.get_tensor_model_parallel_group(),
                vocab_start=ps.get_tensor_model_parallel_rank() * shard,
            )

    def _wrap_ddp(
        self, config: PartsConfig, modules: list[torch.nn.Module]
    ) -> list[torch.nn.Module]:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=self.overlap_grad_reduce,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
        wrapped = [
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=module,
                disable_bucketing=index > 0,  # megatron: only the first chunk overlaps buckets
            )
            for index, (chunk, module) in enumerate(zip(self._chunks, modules, strict=True))
        ]
        model_config: Any = self._chunks[0].config  # the schedule reads the first chunk's
        syncs = [ddp.no_sync for ddp in wrapped]
        model_config.no_sync_func = syncs[0] if len(syncs) == 1 else syncs
        # Loss functions normalise by global token/sequence counts (engine.losses), so megatron
        # must sum gradients over DP and skip its own per-token rescaling.
        model_config.finalize_model_grads_func = functools.partial(
            _finalize_without_token_scaling, finalize_model_grads
        )
        return list(wrapped)

    def build_optimizer(self, config: PartsConfig, *, memory_is_host: bool) -> None:
        self._optimizer = build_optimizer(
            config,
            self._wrapped,
            distributed=self.use_distributed_optimizer,
            overrides=optimizer_overrides_on(memory_is_host, self.optimizer_overrides),
        )
        self._scheduler = build_scheduler(config, self._optimizer)

    # -- steps ---------------------------------------------------------------------------------
    def forward_backward(self, step: Step, consume: MicroBatchConsumer, forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self._require_model()
        config = self._chunks[0].config
        micro_batches = step.micro_batches
        check_micro_batch_count([int(mb.input_ids.shape[0]) for mb in micro_batches], config)
        rows = step_layouts(micro_batches, config)  # once per micro-batch, read by every part
        if self._routing.is_moe:
            self._start_routing(step, rows, forward_only)
        forward_step = ForwardStep(
            rows=rows,
            device=self._device,
            consume=consume,
            head_context=self._head_context,
            fused=self._fused,
            chunks=self._chunks,
            wrapped=self._wrapped,
            routing=self._routing,
            context_group=self._context_group,
            local_attention=self._local_attention,
            ring_attention=self.context_parallel_attention == "ring",
        )
        # Each model chunk (virtual pipeline stage) walks the micro-batches with its own iterator.
        data: list[Iterator[tuple[int, MicroBatch]]] = [
            iter(enumerate(micro_batches)) for _ in self._wrapped
        ]
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data if len(data) > 1 else data[0],
            model=self._wrapped,
            num_microbatches=len(micro_batches),
            seq_length=max(row.width for row in rows),
            micro_batch_size=max(row.rows for row in rows),
            forward_only=forward_only,
        )

    def _start_routing(self, step: Step, rows: Sequence[RowLayout], forward_only: bool) -> None:
        """Clear the routers' records (they keep the step's ``rows``), and scale the aux and z
        losses for this step.

        With per-token losses megatron multiplies each micro-batch's aux / z loss by its real
        tokens (the routers are handed the padding mask) and leaves the division to a finalize
        step that this engine replaces (its losses are normalised by global counts): the
        coefficient is divided here by the step's real tokens over the data-parallel ranks
        (``step.global_tokens``, counted by the Engine), so
        each micro-batch's loss is weighted by its share of the step's tokens, whatever the
        number of micro-batches, the padding or the DP size."""
        from megatron.core.transformer.moe import moe_utils

        self._routing.reset(rows)
        moe_utils.clear_aux_losses_tracker()
        model = self._model
        if (
            model is None
            or forward_only
            or not (model.router_aux_loss_coeff or model.router_z_loss_coeff)
        ):
            return
        total = step.global_tokens
        # megatron divides the z loss by the ranks that split each sequence (tensor x context
        # parallel); each rank's z loss here is already its own tokens' share of the step's
        megatron_config: Any = self._chunks[0].config
        splitting = (
            megatron_config.tensor_model_parallel_size * megatron_config.context_parallel_size
        )
        for chunk in self._chunks:
            chunk_config: Any = chunk.config  # read by the routers at every forward
            chunk_config.moe_aux_loss_coeff = model.router_aux_loss_coeff / total
            chunk_config.moe_z_loss_coeff = (model.router_z_loss_coeff * splitting / total) or None

    def check_router_replay(self, config: PartsConfig) -> None:
        """Router replay runs in every layout: each rank that routes part of every sequence
        (sequence, context parallelism) forces and records its own part."""

    def recorded_routes(self, step: Step) -> list[torch.Tensor]:
        """The routes recorded running ``step``, per micro-batch, ``[b, s, layers, k]``."""
        from megatron.core import parallel_state as ps

        return self._routing.recorded_routes(
            step.micro_batches, ps.get_pipeline_model_parallel_group()
        )

    def router_statistics(self, step: Step) -> dict[str, float]:
        """Per MoE layer: load balance (max / mean tokens per expert) and mean aux / z loss of
        ``step``, the last one run."""
        from megatron.core import parallel_state as ps

        if not self._routing.is_moe:
            return {}
        return self._routing.statistics(
            len(step.micro_batches), ps.get_pipeline_model_parallel_group()
        )

    def check_packing(self, config: PartsConfig) -> None:
        """Packed micro-batches run everywhere; with context parallelism on the local layer
        spec (each sequence cut into 2 x CP chunks by the backend), not yet on
        TransformerEngine's (its attention wants the padded offsets as well)."""
        if config.parallel.context_parallel_size > 1 and uses_transformer_engine(self.layer_spec):
            raise ConfigError(
                "packing with context_parallel_size > 1 is not supported on the "
                "TransformerEngine layer spec yet; use MegatronBackend.layer_spec='local', or "
                "turn one of them off"
            )

    def packed_micro_batch_multiple(self, config: PartsConfig) -> int:
        """Megatron's interleaved (virtual pipeline) schedule runs micro-batches in groups of
        PP; packed rows all have one length under PP, so only the count has to come out even."""
        parallel = config.parallel
        return (
            1
            if parallel.virtual_pipeline_parallel_size is None
            else parallel.pipeline_parallel_size
        )

    # -- offload -------------------------------------------------------------------------------
    def weights_in_host_memory(self) -> bool:
        """Never: they live on the device (the CPU platform's device is the host)."""
        return False

    def offload(self, parts: Iterable[str]) -> None:
        """Move ``parts`` (model, optimizer, grad) to host memory; their device storage is freed."""
        self._require_model()
        tensors = {
            "model": self._model_tensors,
            "grad": lambda: state_tensors.grad_tensors(self._wrapped),
        }
        if self._optimizer is not None:
            tensors["optimizer"] = lambda: state_tensors.optimizer_tensors(self._optimizer)
        self._offloaded.offload(parts, tensors)

    def _model_tensors(self) -> list[torch.Tensor]:
        return state_tensors.model_tensors(self._chunks, self._wrapped)

    def train(self) -> None:
        for module in self._wrapped:
            module.train()

    def eval(self) -> None:
        for module in self._wrapped:
            module.eval()

    def optimizer_zero_grad(self) -> None:
        optimizer = self._require_optimizer()
        for module in self._wrapped:
            module.zero_grad_buffer()  # type: ignore[operator]
        optimizer.zero_grad()

    def grad_norm(self) -> float:
        squares, finish = self.grad_norm_parts()
        return finish([float(square) for square in squares])

    def grad_norm_parts(self) -> tuple[list[torch.Tensor], Callable[[list[float]], float]]:
        optimizer = self._require_optimizer()
        optimizer.prepare_grads()  # gradients where the norm reads them (no loss scaler)
        return grad_norm_parts(optimizer, self._device)

    def optimizer_step(self, grad_norm: float) -> None:
        step_with_grad_norm(self._require_optimizer(), grad_norm)

    def lr_scheduler_step(self) -> float:
        self._require_optimizer()
        self._scheduler.step(increment=1)
        return self.current_lr()

    def current_lr(self) -> float:
        return float(self._require_optimizer().param_groups[0]["lr"])

    # -- layout --------------------------------------------------------------------------------
    def data_parallel_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return int(ps.get_data_parallel_rank())

    def data_parallel_size(self) -> int:
        from megatron.core import parallel_state as ps

        return int(ps.get_data_parallel_world_size())

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        from megatron.core import parallel_state as ps

        group: dist.ProcessGroup = ps.get_data_parallel_group()
        return group

    def holds_outputs(self) -> bool:
        from megatron.core import parallel_state as ps

        return bool(
            ps.get_tensor_model_parallel_rank() == 0
            and ps.is_pipeline_last_stage()
            and ps.get_context_parallel_rank() == 0
        )

    def modules(self) -> list[torch.nn.Module]:
        return list(self._chunks)

    def save_state(self, directory: str) -> FileChecksums:
        """Model, optimizer, LR schedule and RNG states into ``directory`` (collective)."""
        from strategies.backends.megatron.checkpoint import save_state

        self._require_model()
        return save_state(self._chunks, self._optimizer, self._scheduler, directory)

    def stage_state(self, directory: str) -> StagedSave:
        """``save_state``'s collective part and a copy of the state; the model files are left to
        the returned save (for ``save_checkpoint(..., async_save=True)``)."""
        from strategies.backends.megatron.checkpoint import stage_state

        self._require_model()
        return stage_state(
            self._chunks, self._optimizer, self._scheduler, directory, self._staging_buffers
        )

    def load_state(self, directory: str, *, same_layout: bool) -> None:
        """Restore ``save_state``'s directory, resharded to this layout (collective)."""
        from strategies.backends.megatron.checkpoint import load_state

        self._require_model()
        load_state(
            self._chunks, self._optimizer, self._scheduler, directory, same_layout=same_layout
        )

    def export_hf(self, config: PartsConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weights as (Hugging Face name, full tensor) pairs (see ``hf.export``)."""
        from strategies.backends.megatron.hf.export import export_hf

        self._require_model()
        self._check_hf_experts(config)
        for chunk in self._chunks:
            yield from export_hf(chunk, config.model, config)

    def hf_param_shards(self, config: PartsConfig, *, adapter_only: bool) -> Iterator[ParamShard]:
        """This rank's parameters as shards of their Hugging Face tensors (see ``hf.export``)."""
        from strategies.backends.megatron.hf.export import param_shards

        self._require_model()
        self._check_hf_experts(config)
        for chunk in self._chunks:
            yield from param_shards(chunk, config.model, adapter_only=adapter_only)

    def save_hf(self, config: PartsConfig, directory: str) -> None:
        """Write a Hugging Face checkpoint of the model (collective: every rank calls it)."""
        from strategies.backends.megatron.hf.saving import save_hf

        self._require_model()
        self._check_hf_experts(config)
        assert self._head_layer is not None  # built with the model
        save_hf(self._chunks, config.model, self._head_layer, directory, config)

    # -- LoRA ----------------------------------------------------------------------------------
    def check_lora(self, config: PartsConfig) -> None:
        """Dense models on megatron's local layer spec, without sequence parallelism."""
        from strategies.backends.megatron.lora import check_lora

        check_lora(config, uses_transformer_engine(self.layer_spec))

    def export_adapter(self, config: PartsConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's adapters as (Hugging Face name, full tensor) (collective over TP)."""
        from strategies.backends.megatron.hf.export import export_adapter

        self._require_model()
        for chunk in self._chunks:
            yield from export_adapter(chunk)

    def _check_hf_experts(self, config: PartsConfig) -> None:
        """The Hugging Face adapter maps sequential experts (the local layer spec) only."""
        if config.model.is_moe and uses_transformer_engine(self.layer_spec):
            raise ConfigError(
                "Hugging Face weights of a mixture-of-experts model need "
                "MegatronBackend.layer_spec='local' (TransformerEngine's grouped experts are not "
                "mapped to Hugging Face names)"
            )

    def _require_model(self) -> None:
        if not self._wrapped:
            raise EngineStateError("the megatron backend has no model yet: call build_model first")

    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer_spec={self.layer_spec!r})"


def check_experts(config: PartsConfig, world_size: int) -> None:
    """What the megatron backend needs of a mixture-of-experts model and its layout."""
    parallel, model = config.parallel, config.model
    ep, tp, pp = (
        parallel.expert_parallel_size,
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
    )
    if model.num_experts is None:
        if ep > 1:
            raise ConfigError(
                f"ParallelConfig.expert_parallel_size={ep} needs a mixture-of-experts model "
                "(ModelConfig.num_experts is None)"
            )
        return
    if model.num_experts % ep:
        raise ConfigError(
            f"ModelConfig.num_experts ({model.num_experts}) must be divisible by "
            f"expert_parallel_size ({ep})"
        )
    if world_size % (ep * tp * pp):
        raise ConfigError(
            f"expert ({ep}) x tensor ({tp}) x pipeline ({pp}) parallel size must divide the world "
            f"size {world_size} (experts are split over data-parallel ranks)"
        )
    for what, size in (
        ("expert_ffn_hidden_size", model.resolved_expert_ffn_hidden_size),
        ("shared_expert_ffn_hidden_size", model.shared_expert_ffn_hidden_size or 0),
    ):
        if size % tp:
            raise ConfigError(
                f"ModelConfig.{what} ({size}) must be divisible by tensor_parallel_size ({tp})"
            )
    if tp > 1 and not parallel.sequence_parallel and not config.forward_only:
        raise ConfigError(
            "training a mixture-of-experts model with tensor_parallel_size > 1 needs "
            "sequence_parallel (megatron's MoE layer refuses it otherwise); forward-only "
            "engines may use it"
        )
    if (
        model.experts_per_token == 1
        and model.router_score_function == "softmax"
        and model.normalize_expert_weights
    ):
        raise ConfigError(
            "ModelConfig.experts_per_token=1 with normalize_expert_weights=True (each token's one "
            "expert weighted 1) is not supported by the megatron backend: megatron routes one "
            "expert per token only with the softmax over all experts as its weight; set "
            "normalize_expert_weights=False (the top expert's probability, as Switch "
            "Transformer), or experts_per_token >= 2, or use the fsdp2 backend"
        )
    if model.router_score_function == "sigmoid" and not model.normalize_expert_weights:
        raise ConfigError(
            "ModelConfig.normalize_expert_weights=False with router_score_function='sigmoid' is "
            "not supported by the megatron backend (megatron renormalises sigmoid top-k scores)"
        )


def check_micro_batch_count(sizes: list[int], model_config: Any) -> None:
    """The interleaved (virtual pipeline) schedule runs groups of PP equal micro-batches."""
    if model_config.virtual_pipeline_model_parallel_size is None:
        return
    pp = model_config.pipeline_model_parallel_size
    if len(set(sizes)) > 1:
        raise BatchError(
            f"with virtual pipeline stages every micro-batch must hold the same number of "
            f"sequences (megatron's interleaved schedule sends one fixed shape); got {sizes}. "
            "Make the batch size a multiple of micro_batch_size"
        )
    if len(sizes) % pp:  # megatron's groups of PP contiguous micro-batches must come out even
        count = len(sizes)
        raise BatchError(
            f"with virtual pipeline stages the batch must make a multiple of "
            f"pipeline_parallel_size ({pp}) micro-batches; it makes {count}. Change the batch "
            "size, micro_batch_size or max_tokens_per_micro_batch"
        )


def _finalize_without_token_scaling(
    finalize: Any, model: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any
) -> None:
    finalize(model, None, **kwargs)


__all__ = ["MegatronBackend", "transformer_config"]
