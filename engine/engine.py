"""The one Engine class, assembled from a Head, a Backend and a DevicePlatform.

The Engine fixes the lifecycle order (docs/architecture.md, "Lifecycle"); the parts never
call each other out of turn:
resolve parts -> check the combination -> ``platform.setup`` -> ``platform.before_mesh_init``
-> ``backend.init_mesh`` -> ``backend.build_model`` -> ``backend.build_optimizer``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine.config import CallSettings, EngineConfig, call_settings, coerce_config
from engine.data.batching import (
    ROUTED_EXPERTS,
    first_non_finite,
    labels_as_loss_mask,
    restore_outputs,
    to_jagged,
    validated,
)
from engine.data.micro_batching import MicroBatchPlan, plan_fixed, plan_for_data_parallel
from engine.data.routed_experts import check_routed_experts
from engine.host_values import Number, fetch
from engine.losses.contract import (
    LossFn,
    field_granularity,
    is_token_separable,
    metrics_per_name,
    required_fields,
    required_outputs,
)
from engine.non_finite import ZERO_GRADIENT, NonFiniteGuard
from engine.registry import BACKENDS, DEVICES, HEADS, check_part, resolve_device
from engine.step import MicroBatchWork, StepResults, prepare_step, refused_everywhere
from heads.base import (
    PER_SEQUENCE,
    PER_TOKEN,
    Head,
    check_fused,
    declared_results,
)
from heads.errors import BatchError, ConfigError, EngineStateError
from strategies.backends.base import (
    OFFLOAD_PARTS,
    AsyncCheckpointing,
    Backend,
    Checkpointing,
    DeferredGradNorm,
    HuggingFaceExport,
    LowRankAdapters,
    MemoryEstimate,
    Offloading,
    Packing,
    RouterReplay,
    RouterStatistics,
    ShardedExport,
    require,
)
from strategies.devices.base import DevicePlatform
from strategies.hf.files import padding_token_id
from strategies.hf.shards import HfBlock, hf_blocks
from strategies.memory.model_size import check_fits, count_parameters
from strategies.parallel.collectives import collective_device, world_size

if TYPE_CHECKING:
    from engine.checkpointing.async_save import AsyncSave


class Engine:
    """Trains or runs one model (actor, critic, reference, reward) from three parts.

    Build by name with ``Engine.build(head="value", backend="megatron", device="auto")`` or
    pass objects: ``Engine(head=MyHead(), backend=..., platform=..., config=...)``.
    Each data-parallel rank passes its own shard of the batch.
    """

    def __init__(
        self,
        *,
        head: Head,
        backend: Backend,
        platform: DevicePlatform,
        config: EngineConfig | Mapping[str, Any] | None = None,
    ) -> None:
        self.config = coerce_config(config)
        self.head = check_part(head, Head, "head", HEADS.names())
        self.backend = check_part(backend, Backend, "backend", BACKENDS.names())
        self.platform = check_part(platform, DevicePlatform, "platform", DEVICES.names())
        self._check_combination()
        self.platform.require_available()
        self.device: torch.device | None = None
        self._initialized = False
        #: Optimizer steps taken (restored by ``load_checkpoint``; names checkpoint directories).
        self.global_step = 0
        self._guard = NonFiniteGuard(self.config.non_finite)
        self._save_in_flight: AsyncSave | None = None
        #: The mode context the caller is in: "train", "eval", or None (neither).
        self._mode: str | None = None
        #: The Hugging Face checkpoint's pad token id (to refuse unmasked left padding).
        hf_path = self.config.model.hf_path
        self._pad_token_id = padding_token_id(hf_path) if hf_path else None

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        *,
        head: str | Head = "lm",
        backend: str | Backend = "megatron",
        device: str | DevicePlatform = "auto",
        config: EngineConfig | Mapping[str, Any] | None = None,
    ) -> Engine:
        """Resolve names through the registries (options from ``config.head/backend/device``)."""
        resolved = coerce_config(config)
        return cls(
            head=HEADS.create(head, resolved.head) if isinstance(head, str) else head,
            backend=BACKENDS.create(backend, resolved.backend)
            if isinstance(backend, str)
            else backend,
            platform=resolve_device(device, resolved.device),
            config=resolved,
        )

    def _check_combination(self) -> None:
        """Combination rules belong to the parts; this is the one place they are checked."""
        needed = self.backend.required_capabilities(self.config)
        missing = sorted(needed - self.platform.capabilities)
        if missing:
            offered = ", ".join(sorted(self.platform.capabilities)) or "none"
            raise ConfigError(
                f"{', '.join(missing)} is not supported by the {self.platform.name} platform "
                f"with the {self.backend.name} backend (optional features the "
                f"{self.platform.name} platform offers: {offered})"
            )
        self._check_head(self.head)
        if self.config.offload.parts():
            require(self.backend, Offloading)  # config.offload asks for it
        if self.config.packing:
            require(self.backend, Packing).check_packing(self.config)
        if self.config.lora is not None:
            require(self.backend, LowRankAdapters).check_lora(self.config)
        if self.config.router_replay:
            if not self.config.model.is_moe:
                raise ConfigError(
                    "EngineConfig.router_replay needs a mixture-of-experts model "
                    "(ModelConfig.num_experts is None)"
                )
            require(self.backend, RouterReplay).check_router_replay(self.config)
        self.backend.validate(self.config, int(os.environ.get("WORLD_SIZE", "1")))

    def _check_head(self, head: Head) -> None:
        """The built head's, and each call's, declarations."""
        declared = declared_results(head)  # a bad declaration fails here, by name
        if not self.config.forward_only and not declared:
            raise ConfigError(f"head {head.name!r} declares no outputs")
        check_fused(head)

    def _for_call(
        self, settings: CallSettings | Mapping[str, Any] | None
    ) -> tuple[Head, EngineConfig]:
        """The head and config of one call: the built ones with ``settings`` applied, checked
        as the built ones are; never stored (the engine's parts never change after build)."""
        if settings is None:
            return self.head, self.config
        settings = call_settings(settings)
        head = settings.head_of(self.head)
        if head is not self.head:
            self._check_head(head)
            if head.output_spec() != self.head.output_spec():
                raise ConfigError(
                    f"head option(s) {', '.join(sorted(settings.head))} change the model's "
                    f"output layer ({head.output_spec()}), which initialize() built; set them "
                    "in config.head when building the engine"
                )
        return head, settings.config_of(self.config)

    def initialize(self) -> Engine:
        """Set up the device and process group, the mesh, the model and (unless forward-only)
        the optimizer and LR schedule. Returns the engine."""
        if self._initialized:
            return self
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = self.platform.setup(local_rank)
        self._check_model_fits()
        self.platform.before_mesh_init(self.backend, self.config)
        self.backend.init_mesh(self.config.parallel)
        self.backend.build_model(self.config, self.head, self.device)
        if not self.config.forward_only:
            self.backend.build_optimizer(self.config, memory_is_host=self.platform.memory_is_host)
        self._initialized = True
        return self

    def _check_model_fits(self) -> None:
        """A model larger than this rank's device memory is refused naming its sizes, before
        any of it is allocated (the allocator's own error names none)."""
        available = self.platform.memory_available()
        if available is None or not isinstance(self.backend, MemoryEstimate):
            return
        count = count_parameters(self.config.model, self.head.output_spec())
        need = self.backend.memory_per_rank(self.config, count, world_size())
        check_fits(count, need, available, f"the {self.platform.name} device")

    # -- modes ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def train_mode(self) -> Iterator[Engine]:
        """Model in training mode inside, everything on the device; on exit gradients are
        zeroed and the parts ``config.offload`` names go back to host memory."""
        self._check_call("train_mode")
        self.to("device")
        self.backend.train()
        outer, self._mode = self._mode, "train"
        try:
            yield self
        finally:
            self._mode = outer
            if not self.config.forward_only and "grad" not in self._offloaded_parts():
                self.backend.optimizer_zero_grad()
            self._offload_configured()

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[Engine]:
        """Model in evaluation mode inside, on the device; offloads as configured on exit."""
        self._check_call("eval_mode")
        self.to("device", optimizer=False, grad=False)
        self.backend.eval()
        outer, self._mode = self._mode, "eval"
        try:
            yield self
        finally:
            self._mode = outer
            self._offload_configured()

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[Engine]:
        """Inside, the LoRA adapters (``config.lora``) are off: ``infer_batch`` gives the base
        model's outputs exactly (e.g. the reference of an RL actor, without a second engine),
        and ``train_batch`` is refused. Not reentrant. A head whose output is not the vocabulary
        (value, reward) keeps its trained output layer: the base model's body under it."""
        self._check_call("disable_adapter")
        if self.config.lora is None:
            raise ConfigError(
                "disable_adapter() needs LoRA adapters, but config.lora is None (this engine "
                "trains the whole model)"
            )
        adapters = require(self.backend, LowRankAdapters)
        if not adapters.adapters_enabled():
            raise EngineStateError("disable_adapter() is already active (it is not reentrant)")
        adapters.set_adapters_enabled(False)
        try:
            yield self
        finally:
            adapters.set_adapters_enabled(True)

    def to(
        self, device: str, *, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> Engine:
        """``to("cpu")`` moves the chosen parts to host memory (their device storage is freed);
        ``to("device")`` (or the platform's device type, e.g. ``"cuda"``) brings them back."""
        self._check_call("to")
        wanted = {"model": model, "optimizer": optimizer, "grad": grad}
        parts = [name for name in OFFLOAD_PARTS if wanted[name]]
        if device == "cpu":
            require(self.backend, Offloading).offload(parts)
        elif device in ("device", self.platform.device_type):
            require(self.backend, Offloading).reload(parts)
        else:
            raise ConfigError(
                f"to() takes 'cpu' (offload) or 'device' / {self.platform.device_type!r} "
                f"(load back); got {device!r}"
            )
        return self

    def _offload_configured(self) -> None:
        parts = self.config.offload.parts()
        if parts:
            require(self.backend, Offloading).offload(parts)

    # -- steps ---------------------------------------------------------------------------------
    def forward_backward_batch(
        self,
        batch: TensorDict,
        loss_function: LossFn | None,
        forward_only: bool = False,
        *,
        return_outputs: bool = True,
        settings: CallSettings | Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Micro-batch ``batch``, run forward (and backward), return on output ranks
        ``{"model_output": the head's outputs in input order, per-token ones jagged and
        per-sequence ones ``[B]`` (None when ``return_outputs=False``), "loss": [per
        micro-batch], "metrics": {name: [per micro-batch]}}``; other ranks get empty results.
        Outside ``train_mode()`` / ``eval_mode()`` the model runs in the mode the call needs
        (training, or evaluation when ``forward_only``); a training call inside ``eval_mode()``
        is refused. ``settings``: this call's micro-batching and head options (None: the
        built ones)."""
        return self._forward_backward_batch(
            "forward_backward_batch",
            batch,
            loss_function,
            forward_only,
            return_outputs=return_outputs,
            settings=settings,
        )

    def _forward_backward_batch(
        self,
        what: str,
        batch: TensorDict,
        loss_function: LossFn | None,
        forward_only: bool,
        *,
        return_outputs: bool,
        settings: CallSettings | Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """:meth:`forward_backward_batch` on behalf of the public method ``what``."""
        self._check_call(
            what, ("model",) if forward_only else OFFLOAD_PARTS, trains=not forward_only
        )
        if not forward_only and loss_function is None:
            raise ConfigError(
                f"{what} needs a loss_function"
                + (" unless forward_only" if what == "forward_backward_batch" else "")
            )
        head, config = self._for_call(settings)
        self._enter_call_mode(what, training=not forward_only)
        results = self._forward_backward(
            batch, loss_function, forward_only, head, config, return_outputs=return_outputs
        )
        losses, metrics, _ = self._fetch(results)
        if not results.holds_outputs:
            return {"model_output": None, "loss": [], "metrics": {}}
        return {"model_output": results.outputs, "loss": losses, "metrics": metrics}

    def _forward_backward(
        self,
        batch: TensorDict,
        loss_function: LossFn | None,
        forward_only: bool,
        head: Head,
        config: EngineConfig,
        *,
        return_outputs: bool,
    ) -> StepResults:
        """``forward_backward_batch``'s work with the call's ``head`` and ``config``, its
        numbers left where they were computed (on the device) for :meth:`_fetch` to bring over
        in one transfer."""
        self._check_outputs(loss_function, head)
        fields = required_fields(loss_function) if loss_function is not None else ()
        layouts = field_granularity(loss_function) if loss_function is not None else {}
        try:
            rows: tuple[TensorDict, torch.Tensor] | BatchError = self._checked(
                batch, fields, layouts
            )
        except BatchError as error:
            rows = error
        step = prepare_step(
            batch,
            rows,
            lambda lengths: self._plan(lengths, config),
            self.backend.data_parallel_group(),
        )
        results = StepResults.of(step)
        declared = declared_results(head)
        work = MicroBatchWork(
            head=head,
            loss_function=loss_function,
            forward_only=forward_only,
            return_outputs=return_outputs,
            device=self.device or torch.device("cpu"),
            data_parallel_size=self.backend.data_parallel_size(),
            per_token=frozenset(k for k, spec in declared.items() if spec.granularity == PER_TOKEN),
            results=results,
            separable=not forward_only and is_token_separable(loss_function),
        )
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            self.backend.forward_backward(step, work, forward_only)
        if config.router_replay:  # collective: before the ranks without outputs leave
            routes = require(self.backend, RouterReplay).recorded_routes(step)
            for produced_here, routed in zip(results.produced, routes, strict=True):
                if return_outputs:
                    produced_here[ROUTED_EXPERTS] = routed
        results.holds_outputs = self.backend.holds_outputs()
        if results.holds_outputs and return_outputs:
            per_sequence = [k for k, spec in declared.items() if spec.granularity == PER_SEQUENCE]
            results.outputs = restore_outputs(
                results.produced, step.micro_batches, step.rows.batch_size[0], per_sequence
            )
        return results

    def _fetch(
        self, results: StepResults, extra: Iterable[Number] = ()
    ) -> tuple[list[float], dict[str, list[float]], list[float]]:
        """The step's losses, metrics (per name, per micro-batch) and ``extra`` numbers as host
        floats, in one transfer; raises the first deferred head-contract violation."""
        per_name = metrics_per_name(results.metrics)
        extra = list(extra)
        flags = [flag for flag, _ in results.checks]
        values = fetch(
            [*results.losses, *(v for values in per_name.values() for v in values), *flags, *extra]
        )
        losses, rest = values[: len(results.losses)], values[len(results.losses) :]
        metrics = {}
        for name, numbers in per_name.items():
            metrics[name], rest = rest[: len(numbers)], rest[len(numbers) :]
        for (_, message), flag in zip(results.checks, rest, strict=False):
            if flag:
                raise ConfigError(message)
        return losses, metrics, rest[len(flags) :]

    def plan_micro_batches(
        self, batch: TensorDict, *, settings: CallSettings | Mapping[str, Any] | None = None
    ) -> MicroBatchPlan:
        """Which sequences run together: fixed ``micro_batch_size`` groups, or token-budget
        groups (``max_tokens_per_micro_batch``) agreed in count across data-parallel ranks;
        with ``packing`` the budget counts real tokens (``settings``: a call's, as the steps
        take them). The batch is checked as ``forward_backward_batch`` checks it (BatchError).
        Collective over the data-parallel ranks when planning by token budget."""
        config = self._for_call(settings)[1]
        try:
            rows: tuple[TensorDict, torch.Tensor] | BatchError = self._checked(batch)
        except BatchError as error:
            rows = error
        if config.max_tokens_per_micro_batch is not None:  # collective: refused on every rank
            rows = refused_everywhere(rows, self.backend.data_parallel_group())
        if isinstance(rows, BatchError):
            raise rows
        return self._plan(rows[1], config)

    def _checked(
        self, batch: object, fields: Iterable[str] = (), layouts: Mapping[str, str] | None = None
    ) -> tuple[TensorDict, torch.Tensor]:
        """The batch, checked and jagged (``fields`` present, laid out as ``layouts`` says), and
        its sequence lengths; BatchError on this rank alone (a step's refusal reaches every rank
        with its counts)."""
        model = self.config.model
        checked, lengths = validated(
            batch,
            fields,
            granularity=layouts,
            vocab_size=model.vocab_size,
            length_limits=[(model.max_sequence_length, "ModelConfig.max_sequence_length")],
            pad_token_id=self._pad_token_id,
        )
        rows = labels_as_loss_mask(to_jagged(checked))
        check_routed_experts(rows, model, replay=self.config.router_replay)
        return rows, lengths

    def _data_parallel_group_if_any(self) -> dist.ProcessGroup | None:
        """The data-parallel group when there is data parallelism, else None."""
        if self.backend.data_parallel_size() > 1:
            return self.backend.data_parallel_group()
        return None

    def _plan(self, lengths: torch.Tensor, config: EngineConfig) -> MicroBatchPlan:
        budget, packed = config.max_tokens_per_micro_batch, config.packing
        if budget is None:
            return plan_fixed(lengths, config.micro_batch_size, packed=packed)
        group = self._data_parallel_group_if_any()
        multiple = (
            require(self.backend, Packing).packed_micro_batch_multiple(self.config) if packed else 1
        )
        return plan_for_data_parallel(
            lengths, budget, group, packed=packed, count_multiple=multiple
        )

    def train_batch(
        self,
        batch: TensorDict,
        loss_function: LossFn,
        *,
        step_lr: bool = True,
        settings: CallSettings | Mapping[str, Any] | None = None,
    ) -> dict[str, float | str]:
        """Zero grads -> forward/backward -> optimizer step (-> LR step unless ``step_lr=False``);
        ``settings``: this step's micro-batching and head options (None: the built ones).

        Returns ``grad_norm`` (global), the ``lr`` the step used, this rank's ``num_tokens`` and
        ``tokens_per_s``, ``skipped`` (1.0 when the non-finite guard skipped the step, with its
        ``skip_reason``) and ``skipped_steps`` so far; on output ranks (``holds_outputs``) also
        the global batch ``loss`` (micro-batch shares summed over micro-batches and
        data-parallel ranks) and the loss function's metrics (this rank's mean over
        micro-batches).
        """
        self._check_call("train_batch", OFFLOAD_PARTS, trains=True)
        if loss_function is None:
            raise ConfigError(
                "train_batch needs a loss_function (forward_backward_batch(batch, None, "
                "forward_only=True) or infer_batch runs a batch without one)"
            )
        head, config = self._for_call(settings)
        self._enter_call_mode("train_batch", training=True)
        start = time.perf_counter()
        self.backend.optimizer_zero_grad()
        results = self._forward_backward(
            batch, loss_function, False, head, config, return_outputs=False
        )
        lr = self.backend.current_lr()
        # every number of the step in one transfer: losses, metrics, the gradient norm and, with
        # data parallelism, the global loss (summed on the device)
        norm_parts, finish_norm = self._grad_norm_parts()
        extra = list(norm_parts)
        group = self._data_parallel_group_if_any()
        if results.holds_outputs and group is not None:
            extra.append(self._data_parallel_sum_on_device(results.losses, group))
        losses, metrics, extra_values = self._fetch(results, extra)
        grad_norm = finish_norm(extra_values[: len(norm_parts)])
        loss = sum(losses) if losses else None
        grad_norm, skip_reason = self._guarded_step(loss, batch, grad_norm=grad_norm)
        if step_lr and skip_reason is None:
            self.backend.lr_scheduler_step()
        elapsed = time.perf_counter() - start
        num_tokens = int(results.step.lengths.sum())
        summary: dict[str, float | str] = {
            name: sum(values) / len(values) for name, values in metrics.items() if values
        }
        if isinstance(self.backend, RouterStatistics):  # collective: on every rank
            summary.update(self.backend.router_statistics(results.step))
        if results.holds_outputs:
            summary["loss"] = extra_values[-1] if group is not None else sum(losses)
        summary.update(
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=float(num_tokens),
            tokens_per_s=num_tokens / elapsed if elapsed > 0 else float("inf"),
            skipped=float(skip_reason is not None),
            skipped_steps=float(self._guard.skipped_steps),
        )
        if skip_reason is not None:
            summary["skip_reason"] = skip_reason
        return summary

    def infer_batch(
        self,
        batch: TensorDict,
        loss_function: LossFn | None = None,
        *,
        settings: CallSettings | Mapping[str, Any] | None = None,
    ) -> TensorDict:
        """Forward only, no gradients: the head's outputs in input order, per-token ones jagged,
        per-sequence ones ``[B]`` (None on ranks that hold no outputs); with
        ``config.router_replay`` also ``routed_experts`` (jagged ``[B, tokens, layers, k]``).
        ``settings``: this call's micro-batching and head options (None: the built ones)."""
        result = self._forward_backward_batch(
            "infer_batch", batch, loss_function, True, return_outputs=True, settings=settings
        )
        output: TensorDict = result["model_output"]
        return output

    def optimizer_zero_grad(self) -> None:
        self._check_call("optimizer_zero_grad", ("grad",), trains=True)
        self.backend.optimizer_zero_grad()

    def optimizer_step(self) -> float:
        """Clip and apply the gradients, unless the non-finite guard skips the step (see
        ``NonFiniteConfig``); returns the global gradient norm (before clipping)."""
        self._check_call("optimizer_step", OFFLOAD_PARTS, trains=True)
        return self._guarded_step(None)[0]

    def _guarded_step(
        self,
        loss: float | None,
        batch: TensorDict | None = None,
        *,
        grad_norm: float | None = None,
    ) -> tuple[float, str | None]:
        """The gradient norm (measured here unless given), and why the step was skipped
        (None: it was applied); the caller has checked the call (:meth:`_check_call`)."""
        if grad_norm is None:
            grad_norm = self.backend.grad_norm()
        values = {"loss": loss, "grad_norm": grad_norm, "lr": self.backend.current_lr()}
        reason = self._guard.reason_to_skip(values)
        if reason is None:
            self.backend.optimizer_step(grad_norm)
            self.global_step += 1
        else:
            self.backend.optimizer_zero_grad()
            where = first_non_finite(batch) if batch is not None else None
            if where and reason != ZERO_GRADIENT:
                reason += f" (the batch's {where})"
        self._guard.record(reason)
        return grad_norm, reason

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule; returns the new learning rate."""
        self._check_call("lr_scheduler_step", trains=True)
        return self.backend.lr_scheduler_step()

    # -- layout --------------------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        self._check_call("get_data_parallel_rank")
        return self.backend.data_parallel_rank()

    def get_data_parallel_size(self) -> int:
        self._check_call("get_data_parallel_size")
        return self.backend.data_parallel_size()

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        self._check_call("get_data_parallel_group")
        return self.backend.data_parallel_group()

    def holds_outputs(self) -> bool:
        """Whether this rank receives outputs and loss metrics (with model parallelism: tensor
        rank 0 of the last pipeline stage, context rank 0)."""
        self._check_call("holds_outputs")
        return self.backend.holds_outputs()

    # -- weights -------------------------------------------------------------------------------
    def get_per_tensor_param(
        self, *, adapter_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weights as (Hugging Face name, full tensor), one at a time (e.g. to update
        an inference engine). Collective over tensor- and expert-parallel ranks (every expert
        comes out on every rank); under pipeline parallelism each stage yields its own
        layers. With LoRA the adapted linears come out merged (``W + (B @ A) * alpha / rank``);
        ``adapter_only=True`` yields the adapters alone, under peft's names
        (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), and a value or
        reward head's output layer, which trains whole, as peft's ``modules_to_save`` has it
        (``base_model.model.score.weight``, and a zero ``score.bias``). Inside
        ``disable_adapter()`` the weights are the base model's, the adapters not merged."""
        self._check_call("get_per_tensor_param", ("model",))
        if adapter_only:
            weights = self._peft_adapter("get_per_tensor_param")
        else:
            config = self.config
            if (
                config.lora is not None
                and not require(self.backend, LowRankAdapters).adapters_enabled()
            ):
                config = config.replace(lora=None)  # the base model's weights
            weights = require(self.backend, HuggingFaceExport).export_hf(config)
        return _WhileResident(weights, lambda: self._check_call(WHILE_ITERATING, ("model",)))

    def get_per_tensor_param_shard(self, *, adapter_only: bool = False) -> Iterator[HfBlock]:
        """The tensors ``get_per_tensor_param`` yields, as this rank's block of each
        (``strategies.hf.shards.HfBlock``: which rows and columns of the Hugging Face tensor,
        whether this rank's copy is the one to take), nothing gathered and nothing copied where
        the layout allows (a block may be a view of the live weights). Every rank yields one
        block per tensor of the whole model in the same order, so a receiver gathers each over
        the default process group; collective once, to agree on the blocks' places. With LoRA:
        ``adapter_only=True`` (the adapters), or inside ``disable_adapter()`` (the base model);
        the merged weights change everywhere each step and are refused."""
        self._check_call("get_per_tensor_param_shard", ("model",))
        sharded = require(self.backend, ShardedExport)
        config = self.config
        if adapter_only:
            from strategies.model.peft_lora import peft_shards

            if config.lora is None:
                raise ConfigError(
                    "get_per_tensor_param_shard(adapter_only=True) needs LoRA, but config.lora "
                    "is None"
                )
            shards = peft_shards(sharded.hf_param_shards(config, adapter_only=True))
        else:
            if config.lora is not None:
                if require(self.backend, LowRankAdapters).adapters_enabled():
                    raise ConfigError(
                        "get_per_tensor_param_shard: the merged LoRA weights are not exported "
                        "as shards (every element changes each step); take adapter_only=True, "
                        "or the base model inside disable_adapter()"
                    )
                config = config.replace(lora=None)
            shards = sharded.hf_param_shards(config, adapter_only=False)
        blocks = hf_blocks(shards)
        return _WhileResident(blocks, lambda: self._check_call(WHILE_ITERATING, ("model",)))

    def _peft_adapter(self, what: str) -> Iterator[tuple[str, torch.Tensor]]:
        from strategies.model.peft_lora import peft_tensors

        if self.config.lora is None:
            raise ConfigError(f"{what}(adapter_only=True) needs LoRA, but config.lora is None")
        return peft_tensors(require(self.backend, LowRankAdapters).export_adapter(self.config))

    def save_hf(self, directory: str | os.PathLike[str], *, adapter_only: bool = False) -> None:
        """Write a Hugging Face checkpoint (safetensors + config.json) to ``directory``,
        atomically, LoRA adapters merged into their linears: a causal LM, or for a value head
        (per-token results) a ``...ForTokenClassification`` and for a reward head (per-sequence
        results) a ``...ForSequenceClassification``, ``num_labels`` the head's features. With
        ``adapter_only=True`` a PEFT adapter directory instead (``adapter_config.json`` +
        ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the
        base model (a value or reward head's: onto ``AutoModelForTokenClassification`` of the
        base checkpoint, ``num_labels`` the head's features, its ``score`` layer replaced).
        Collective: every rank calls it."""
        self._check_call("save_hf", ("model",))
        if adapter_only:
            from strategies.model.peft_lora import save_peft_adapter

            lora = self.config.lora
            tensors = self._peft_adapter("save_hf")
            assert lora is not None  # _peft_adapter refuses an engine without
            head_layer = self.head.output_spec().kind != "vocab"
            save_peft_adapter(
                tensors, lora, self.config.model, os.fspath(directory), head_layer=head_layer
            )
            return
        require(self.backend, HuggingFaceExport).save_hf(self.config, os.fspath(directory))

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        global_step: int | None = None,
        max_ckpt_to_keep: int | None = None,
        *,
        async_save: bool = False,
    ) -> str:
        """Save model, optimizer, LR schedule and RNG states to ``path/global_step_{N}/``
        (N: ``global_step``, default ``self.global_step``), published atomically; keep only the
        newest ``max_ckpt_to_keep``. Collective: every rank calls it. Returns the directory.

        With ``async_save`` (a backend with the ``async_checkpoints`` ability) it returns once
        the state is copied to host memory; the files are written in the background and the
        directory appears when complete. The next save or load, :meth:`wait_for_checkpoint`
        and the process's exit wait for it, and raise CheckpointError if it failed."""
        from engine.checkpointing.async_save import start_async_save
        from engine.checkpointing.save import save_checkpoint

        self._check_call("save_checkpoint", OFFLOAD_PARTS)
        state = require(self.backend, Checkpointing)
        self.wait_for_checkpoint()
        step = self.global_step if global_step is None else global_step
        description = self._checkpoint_description()
        if not async_save:
            return save_checkpoint(state, description, os.fspath(path), step, max_ckpt_to_keep)
        self._save_in_flight = start_async_save(
            require(self.backend, AsyncCheckpointing),
            description,
            os.fspath(path),
            step,
            max_ckpt_to_keep,
        )
        return self._save_in_flight.target

    def wait_for_checkpoint(self) -> str | None:
        """Block until the asynchronous save in flight (if any) is published; CheckpointError
        if it failed. Collective. Returns its directory."""
        from engine.checkpointing.async_save import finish_async_save

        save, self._save_in_flight = self._save_in_flight, None
        return None if save is None else finish_async_save(save)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> str:
        """Restore a checkpoint: ``path`` is a root (its newest complete checkpoint) or one
        ``global_step_*`` directory. Verified first; on CheckpointError nothing changed. The
        model and optimizer reshard to this engine's parallel layout; RNG states are restored
        at the same layout only. Collective. Returns the directory loaded."""
        from engine.checkpointing.load import load_checkpoint

        self._check_call("load_checkpoint", OFFLOAD_PARTS)
        state = require(self.backend, Checkpointing)
        self.wait_for_checkpoint()
        directory, self.global_step, guard = load_checkpoint(
            state, self._checkpoint_description(), os.fspath(path)
        )
        self._guard.restore(guard)
        return directory

    def _checkpoint_description(self) -> dict[str, Any]:
        """What a checkpoint records of this engine, and what a load must match."""
        return {
            "head": self.head.name,
            "backend": self.backend.name,
            "model": self.config.model,
            "parallel": {**self.config.to_dict()["parallel"], "world_size": world_size()},
            "config": self.config.to_dict(),
            "non_finite": self._guard.counters(),
        }

    # -- internals -----------------------------------------------------------------------------
    def _check_call(self, what: str, needs: tuple[str, ...] = (), *, trains: bool = False) -> None:
        """Whether the public call ``what`` may run now (EngineStateError saying what to do), in
        one order: the engine initialised; for a call that ``trains``, an engine that trains
        (not ``forward_only``) and, where the call changes the weights (it ``needs`` the model),
        its LoRA adapters on (zeroing gradients and stepping the LR schedule do not need them);
        the parts it ``needs`` (of ``OFFLOAD_PARTS``) on the device."""
        if not self._initialized:
            raise EngineStateError(f"{what}() needs an initialised engine: call initialize() first")
        if trains and self.config.forward_only:
            raise EngineStateError(
                f"{what}() trains, but this engine is forward-only (config.forward_only=True, e.g. "
                "a reference model); use infer_batch()"
            )
        backend = self.backend
        changes_weights = trains and "model" in needs
        if (
            changes_weights
            and isinstance(backend, LowRankAdapters)
            and not backend.adapters_enabled()
        ):
            raise EngineStateError(
                f"{what}() trains the LoRA adapters, but they are off inside disable_adapter(); "
                "train outside it (inside, use infer_batch() for the base model's outputs)"
            )
        away = sorted(self._offloaded_parts() & set(needs))
        if away:
            raise EngineStateError(
                f"{what}() needs the {', '.join(away)} on the device, but "
                f"{'they are' if len(away) > 1 else 'it is'} offloaded; "
                "call engine.to('device') or work inside train_mode() / eval_mode()"
            )

    def _offloaded_parts(self) -> frozenset[str]:
        return self.backend.offloaded() if isinstance(self.backend, Offloading) else frozenset()

    def _check_outputs(self, loss_function: LossFn | None, head: Head) -> None:
        """The head outputs the loss declares it reads (``required_outputs``) are ``head``'s,
        checked before any compute (ConfigError naming the output and the head's options)."""
        if loss_function is None:
            return
        produced = declared_results(head)
        missing = [name for name in required_outputs(loss_function) if name not in produced]
        if missing:
            owner = getattr(loss_function, "__qualname__", type(loss_function).__name__)
            raise ConfigError(
                f"{owner} reads the head output(s) {', '.join(map(repr, missing))}, which head "
                f"{head.name!r} does not produce as configured (its outputs: "
                f"{', '.join(produced)}); turn the output on in the head's options (an LM head's "
                "entropy: compute_entropy=True) or use a loss that does not read it"
            )

    def _enter_call_mode(self, what: str, *, training: bool) -> None:
        """The model's mode for one call: a training call inside ``eval_mode()`` is refused
        (evaluation mode turns dropout off: it would train silently in the wrong mode);
        outside both mode contexts a call runs in the mode it needs."""
        if training and self._mode == "eval":
            raise EngineStateError(
                f"{what}() trains, but it is called inside eval_mode() (the model in evaluation "
                "mode, dropout off); call it inside `with engine.train_mode():`, or outside both"
            )
        if self._mode is None:
            if training:
                self.backend.train()
            else:
                self.backend.eval()

    def _grad_norm_parts(self) -> tuple[list[Number], Callable[[list[float]], float]]:
        """The gradient norm's device tensors and how to finish it from their host values:
        the backend's own where it can leave them on the device (``DeferredGradNorm``)."""
        if isinstance(self.backend, DeferredGradNorm):
            tensors, finish = self.backend.grad_norm_parts()
            return list(tensors), finish
        return [self.backend.grad_norm()], lambda values: values[0]

    def _data_parallel_sum_on_device(
        self, losses: list[Number], group: dist.ProcessGroup
    ) -> torch.Tensor:
        """The sum of ``losses`` over the data-parallel group (whose members are all output
        ranks, or none), reduced where the group's backend needs it without a host round trip
        on the device."""
        where = collective_device(group)
        total = torch.zeros((), dtype=torch.float64, device=where)
        for value in losses:
            total += value.to(where, torch.float64) if isinstance(value, torch.Tensor) else value
        dist.all_reduce(total, group=group)
        return total


WHILE_ITERATING = "get_per_tensor_param() (while its iterator is in use)"
T = TypeVar("T")


class _WhileResident(Iterator[T]):
    """``items``, calling ``check`` before each one: an offload between two tensors (say on
    leaving ``eval_mode``) raises EngineStateError instead of reading freed storage, and after
    ``to("device")`` the same iterator goes on."""

    def __init__(self, items: Iterator[T], check: Callable[[], None]) -> None:
        self._items, self._check = items, check

    def __next__(self) -> T:
        self._check()
        return next(self._items)
