"""The Megatron-core backend: mesh, GPTModel, megatron DDP + optimizer, forward-backward schedule.

megatron-core is imported inside methods only, so listing or constructing the backend is cheap.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
from typing_extensions import override

from heads.base import Head, HeadContext
from heads.errors import ConfigError, EngineStateError
from heads.validation import bool_field, one_of
from strategies.backends.base import MicroBatchConsumer
from strategies.backends.megatron import mesh
from strategies.backends.megatron.model import (
    build_gpt_model,
    transformer_config,
    uses_transformer_engine,
)
from strategies.backends.megatron.optimizer import build_optimizer, build_scheduler
from strategies.backends.megatron.version import check_megatron_version
from strategies.config import ParallelConfig, PartsConfig

if TYPE_CHECKING:
    import torch.distributed as dist

    from engine.batching import MicroBatch


@attrs.define(kw_only=True)
class MegatronBackend:
    """Megatron-core (GPTModel, local or TransformerEngine layer spec)."""

    name: ClassVar[str] = "megatron"

    #: ``auto``: TransformerEngine's layer spec where it is installed, else megatron's local one.
    layer_spec: str = attrs.field(
        default="auto", validator=one_of("auto", "local", "transformer_engine")
    )
    overlap_grad_reduce: bool = bool_field(False)

    _chunks: list[torch.nn.Module] = attrs.field(factory=list, init=False)
    _wrapped: list[torch.nn.Module] = attrs.field(factory=list, init=False)
    _optimizer: Any = attrs.field(default=None, init=False)
    _scheduler: Any = attrs.field(default=None, init=False)
    _device: torch.device = attrs.field(factory=lambda: torch.device("cpu"), init=False)
    _head_context: HeadContext = attrs.field(factory=HeadContext, init=False)

    # -- checks --------------------------------------------------------------------------------
    def required_capabilities(self, config: PartsConfig) -> frozenset[str]:
        parallel = config.parallel
        wanted = {"sequence_parallel"} if parallel.sequence_parallel else set()
        if parallel.context_parallel_size > 1:
            wanted.add("context_parallel")
        return frozenset(wanted)

    def validate(self, config: PartsConfig, world_size: int) -> None:
        check_megatron_version()
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
        if parallel.virtual_pipeline_parallel_size is not None:
            raise ConfigError(
                "virtual_pipeline_parallel_size is not supported by this engine yet; leave it unset"
            )
        if parallel.expert_parallel_size > 1:
            raise ConfigError(
                f"expert_parallel_size={parallel.expert_parallel_size} needs a mixture-of-experts "
                "model; ModelConfig describes dense models only"
            )
        uses_transformer_engine(self.layer_spec, parallel)
        if config.model.max_sequence_length <= 1:
            raise ConfigError("ModelConfig.max_sequence_length must be > 1")

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
        chunk = build_gpt_model(
            config,
            spec,
            self.layer_spec,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
        ).to(device)
        self._chunks = [chunk]
        wrapped: torch.nn.Module = chunk
        if config.dtype == "bfloat16":
            wrapped = Float16Module(chunk.config, chunk)
        if not config.forward_only:
            wrapped = self._wrap_ddp(config, wrapped)
        self._wrapped = [wrapped]
        tp = ps.get_tensor_model_parallel_world_size()
        if spec.kind == "vocab" and tp > 1:
            shard = config.model.vocab_size // tp
            self._head_context = HeadContext(
                tensor_parallel_group=ps.get_tensor_model_parallel_group(),
                vocab_start=ps.get_tensor_model_parallel_rank() * shard,
            )

    def _wrap_ddp(self, config: PartsConfig, module: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp = DistributedDataParallel(
            config=self._chunks[0].config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=self.overlap_grad_reduce,
                use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
            ),
            module=module,
        )
        model_config: Any = self._chunks[0].config
        model_config.no_sync_func = ddp.no_sync
        # Loss functions normalise by global token/sequence counts (DESIGN.md), so megatron
        # must sum gradients over DP and skip its own per-token rescaling.
        model_config.finalize_model_grads_func = functools.partial(
            _finalize_without_token_scaling, finalize_model_grads
        )
        return ddp

    def build_optimizer(self, config: PartsConfig) -> None:
        self._optimizer = build_optimizer(config, self._wrapped)
        self._scheduler = build_scheduler(config, self._optimizer)

    # -- steps ---------------------------------------------------------------------------------
    def forward_backward(
        self, micro_batches: Sequence[MicroBatch], consume: MicroBatchConsumer, forward_only: bool
    ) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self._require_model()
        data: Iterator[tuple[int, MicroBatch]] = iter(enumerate(micro_batches))
        device, head_context = self._device, self._head_context

        def forward_step(iterator: Iterator[tuple[int, MicroBatch]], model: Any) -> Any:
            index, micro_batch = next(iterator)
            input_ids = micro_batch.input_ids.to(device=device, dtype=torch.long)
            positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
            output = model(input_ids, positions, attention_mask=None)

            def loss_func(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
                loss, metrics = consume(index, raw, head_context)
                return loss, torch.ones((), dtype=torch.int), metrics

            return output, loss_func

        longest = max(int(mb.input_ids.shape[1]) for mb in micro_batches)
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self._wrapped,
            num_microbatches=len(micro_batches),
            seq_length=longest,
            micro_batch_size=max(len(mb.indices) for mb in micro_batches),
            forward_only=forward_only,
        )

    def train(self) -> None:
        for module in self._wrapped:
            module.train()

    def eval(self) -> None:
        for module in self._wrapped:
            module.eval()

    def optimizer_zero_grad(self) -> None:
        self._require_optimizer()
        for module in self._wrapped:
            module.zero_grad_buffer()  # type: ignore[operator]
        self._optimizer.zero_grad()

    def optimizer_step(self) -> float:
        self._require_optimizer()
        _, grad_norm, _ = self._optimizer.step()
        return float("nan") if grad_norm is None else float(grad_norm)

    def lr_scheduler_step(self) -> float:
        self._require_optimizer()
        self._scheduler.step(increment=1)
        return self.current_lr()

    def current_lr(self) -> float:
        self._require_optimizer()
        return float(self._optimizer.param_groups[0]["lr"])

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

    def is_mp_src_rank_with_outputs(self) -> bool:
        from megatron.core import parallel_state as ps

        return bool(
            ps.get_tensor_model_parallel_rank() == 0
            and ps.is_pipeline_last_stage()
            and ps.get_context_parallel_rank() == 0
        )

    def modules(self) -> list[torch.nn.Module]:
        return list(self._chunks)

    def _require_model(self) -> None:
        if not self._wrapped:
            raise EngineStateError("the megatron backend has no model yet: call build_model first")

    def _require_optimizer(self) -> None:
        if self._optimizer is None:
            raise EngineStateError(
                "this engine has no optimizer (forward-only, or not initialised)"
            )

    @override
    def __repr__(self) -> str:
        return f"MegatronBackend(layer_spec={self.layer_spec!r})"


def _finalize_without_token_scaling(
    finalize: Any, model: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any
) -> None:
    finalize(model, None, **kwargs)


__all__ = ["MegatronBackend", "transformer_config"]
