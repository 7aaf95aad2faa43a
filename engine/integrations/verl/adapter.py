"""``ComposableEngine``: verl's ``BaseEngine`` interface over this project's one ``Engine``.

One class for every registered cell (``cells.registered_cells``): the head, backend and device
come from verl's model type, the engine config's ``strategy`` and verl's device, through the
project's registries.

Data contract (verl's ``NO_PADDING`` layout): ``input_ids`` jagged; verl's per-token outputs are
aligned with the *next* token (``log_probs[t] = log p(x_{t+1} | x_<=t)``, ``values[t] = V(x_<=t)``,
the last entry of a row unused), this engine's with the token they score (``log_probs[t] = log
p(x_t | x_<t)``, entry 0 unused): the adapter shifts each row left by one. verl's loss functions
are called per micro-batch as verl's engines call them, ``loss_fn(model_output=, data=,
dp_group=)``, with the micro-batch's rows of verl's own TensorDict (every field and non-tensor
entry) and ``dp_size`` / ``batch_num_tokens`` assigned first (the loss-mask sum over
data-parallel ranks: the step's global count of :data:`LOSS_MASK_COUNT`, which the adapter hands
the engine). verl's losses are scaled for
gradients *averaged* over data-parallel ranks (a factor ``dp_size``); this engine sums them, so
the adapter divides by ``dp_size`` before the backward pass and reports verl's values.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine

from engine.checkpointing.retention import complete_checkpoints
from engine.config import CallSettings, EngineConfig, head_options
from engine.data.batching import (
    ROUTED_EXPERTS,
    RowSelector,
    jagged_offsets,
    jagged_values,
    jagged_view,
)
from engine.engine import Engine
from engine.integrations.verl.cells import registered_cells
from engine.integrations.verl.translation import (
    engine_config_from_verl,
    lora_base_name,
    lora_merged,
    replay_mode,
)
from engine.losses.contract import LossContext
from engine.weight_sync import DeltaExport
from heads.base import PER_SEQUENCE, ResultSpec, declared_results
from heads.errors import BatchError, ConfigError
from strategies.backends.base import OFFLOAD_PARTS, Offloading
from strategies.hf.shards import whole_tensors

#: The engine batch's field counting verl's ``loss_mask``: per row as many ones as the row's
#: loss mask, at its last tokens (verl's mask may be response-length), so that the step's one
#: all-reduce of counts also sums verl's ``batch_num_tokens``.
LOSS_MASK_COUNT = "verl_loss_mask"
NO_PADDING = "no_padding"
#: The largest flat position verl's delta wire (int32) addresses.
INT32_MAX = 2**31 - 1
T = TypeVar("T")
#: Non-tensor flags verl's engines understand that this one cannot honour, and why.
REFUSED_FLAGS = {
    "distillation_use_topk": "no top-k distillation outputs",
    "distillation_only": "no distillation outputs",
}


def _flag(data: TensorDict, key: str, default: Any) -> Any:
    return tu.get_non_tensor_data(data=data, key=key, default=default)


def to_verl_layout(
    values: torch.Tensor, lengths: torch.Tensor, spec: ResultSpec, key: str
) -> torch.Tensor:
    """The head's output ``key`` (declared ``spec``) in verl's layout; differentiable.

    Per-token: right-padded ``[b, s, *features]`` aligned with the scored token -> jagged
    ``[b, j, *features]`` aligned with the next token (each row shifted left by one, its last
    entry 0). Per-sequence ``[b, *features]``: as it is (no token to align). ConfigError naming
    the key for a shape that is not the declared one, rather than a silently mis-shaped result.
    """
    rows = lengths.shape[0]
    if spec.granularity == PER_SEQUENCE:
        _check_shape(key, values, (rows, *spec.features), "[b, *features]")
        return values
    _check_shape(key, values, (rows, None, *spec.features), "[b, s, *features]")
    positions = torch.arange(values.shape[1], device=values.device)
    keep = (positions < (lengths[:, None] - 1)).reshape(rows, -1, *[1] * len(spec.features))
    shifted = torch.roll(values, shifts=-1, dims=1) * keep
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    return jagged_view(shifted[positions < lengths[:, None]], offsets)


def jagged_to_verl_layout(values: torch.Tensor, spec: ResultSpec, key: str) -> torch.Tensor:
    """The engine's returned output ``key``: per-token jagged ``[b, j, *features]`` aligned with
    the scored token -> verl's layout (see ``to_verl_layout``); per-sequence as it is."""
    if spec.granularity == PER_SEQUENCE:
        _check_shape(key, values, (values.shape[0], *spec.features), "[b, *features]")
        return values
    if not values.is_nested:
        raise ConfigError(
            f"output {key!r} is declared per-token but came back as a dense tensor of shape "
            f"{tuple(values.shape)}; cannot convert it to verl's layout"
        )
    offsets = jagged_offsets(values)
    flat = jagged_values(values)
    _check_shape(key, flat, (None, *spec.features), "[tokens, *features]")
    shifted = torch.roll(flat, shifts=-1, dims=0)
    last = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
    last[offsets[1:] - 1] = True
    shifted = shifted.masked_fill(last.reshape(-1, *[1] * len(spec.features)), 0.0)
    return jagged_view(shifted, offsets)


def _check_shape(
    key: str, values: torch.Tensor, expected: tuple[int | None, ...], layout: str
) -> None:
    """``values`` has ``expected`` dims (None: any size), else ConfigError naming ``key``."""
    shape = tuple(values.shape)
    if len(shape) != len(expected) or any(
        want is not None and got != want for got, want in zip(shape, expected, strict=True)
    ):
        wanted = ", ".join("*" if want is None else str(want) for want in expected)
        raise ConfigError(
            f"output {key!r} has shape {shape}, not the declared {layout} ({wanted}); cannot "
            "convert it to verl's layout"
        )


class ComposableEngine(BaseEngine):
    """verl's engine interface (``verl.workers.engine.BaseEngine``) delegating to ``Engine``."""

    def __init__(
        self,
        model_config: Any,
        engine_config: Any,
        optimizer_config: Any,
        checkpoint_config: Any,
        **unsupported: Any,
    ) -> None:
        super().__init__()
        if unsupported:
            raise ConfigError(
                f"ComposableEngine got unsupported argument(s): {', '.join(sorted(unsupported))}"
            )
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode: str | None = None
        world = dist.get_world_size() if dist.is_initialized() else 1
        head, backend, config = engine_config_from_verl(
            model_config=model_config,
            engine_config=engine_config,
            optimizer_config=optimizer_config,
            checkpoint_config=checkpoint_config,
            world_size=world,
        )
        device = os.getenv("VERL_ENGINE_DEVICE") or get_device_name()
        self.engine = _build(head, backend, device, config)
        #: Whether verl's ``to("cpu")`` offloads to host memory. Not where the device's memory
        #: is the host's (the CPU platform): there verl's calls that load
        #: (``to(get_device_name())``) and those that offload (``to("cpu")``) name the same
        #: device, so every call loads.
        self.offload_to_host = not self.engine.platform.memory_is_host
        #: The ``local_path`` of each checkpoint this process saved, oldest first (retention).
        self._saved: list[str] = []
        #: The delta weight sync's base (``prime_delta_snapshots``).
        self._deltas = DeltaExport()

    # -- lifecycle -----------------------------------------------------------------------------
    def initialize(self) -> None:
        """Build the model and optimizer (idempotent), then offload as verl's config says."""
        self._initialized()
        self.to(
            "cpu",
            model=self.is_param_offload_enabled,
            optimizer=self.is_optimizer_offload_enabled,
            grad=self.is_param_offload_enabled,
        )

    def _initialized(self) -> Engine:
        """The engine, initialised on first need: verl asks for the data-parallel rank right
        after construction, before ``initialize``."""
        return self.engine.initialize()

    @property
    def module(self) -> Any:
        """The model as verl's ``DetachActorWorker`` copies it to host memory and back
        (``actor.engine.module``, its ``separate_async`` trainer's old policy): the chunks this
        rank holds for verl's megatron handlers, the one module for its fsdp2 ones."""
        modules = self.engine.backend.modules()
        if getattr(self.engine_config, "strategy", None) == "megatron" or len(modules) != 1:
            return modules
        return modules[0]

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(getattr(self.engine_config, "param_offload", False)) and not self._in_host

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        offload = bool(getattr(self.engine_config, "optimizer_offload", False))
        return offload and not self._in_host

    @property
    def _in_host(self) -> bool:
        """The backend keeps the model in host memory already (fsdp2's ``cpu_offload``, verl's
        ``offload_policy``): verl turns its phase offloads off then."""
        backend = self.engine.backend
        return isinstance(backend, Offloading) and backend.weights_in_host_memory()

    @contextlib.contextmanager
    def train_mode(self, **kwargs: Any) -> Iterator[ComposableEngine]:
        with self._mode("train", **kwargs):
            yield self

    @contextlib.contextmanager
    def eval_mode(self, **kwargs: Any) -> Iterator[ComposableEngine]:
        with self._mode("eval", **kwargs):
            yield self

    @contextlib.contextmanager
    def _mode(
        self, mode: str, *, disable_auto_offload: bool = False, **kwargs: Any
    ) -> Iterator[None]:
        """verl's mode contexts: on exit the parts its config offloads go to host memory
        (unless ``disable_auto_offload``); the engine's own mode context brings them back."""
        kwargs.pop("zero_grad_on_exit", None)
        if kwargs:
            raise ConfigError(f"{mode}_mode got unsupported argument(s): {', '.join(kwargs)}")
        engine = self._initialized()
        self.mode = mode
        context = engine.train_mode() if mode == "train" else engine.eval_mode()
        try:
            with context:
                yield
        finally:
            self.mode = None
            if not disable_auto_offload:
                train = mode == "train"
                self.to(
                    "cpu",
                    model=self.is_param_offload_enabled,
                    optimizer=train and self.is_optimizer_offload_enabled,
                    grad=train and self.is_param_offload_enabled,
                )

    def to(
        self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """``"cpu"`` offloads the chosen parts (see ``offload_to_host``), the device's name (or
        ``"device"``) loads them. A forward-only engine has no optimizer or gradients."""
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        engine = self._initialized()
        if engine.config.forward_only:
            optimizer = grad = False
        if model or optimizer or grad:
            target = "cpu" if device == "cpu" and self.offload_to_host else "device"
            engine.to(target, model=model, optimizer=optimizer, grad=grad)

    def _offloaded(self) -> frozenset[str]:
        backend = self._initialized().backend
        return backend.offloaded() if isinstance(backend, Offloading) else frozenset()

    @contextlib.contextmanager
    def _resident(self, parts: tuple[str, ...] = OFFLOAD_PARTS) -> Iterator[Engine]:
        """``parts`` on the device inside, whatever verl offloaded (verl checkpoints and exports
        weights between its modes); what was offloaded goes back on exit."""
        engine = self._initialized()
        away = self._offloaded() & set(parts)
        chosen = {part: part in away for part in OFFLOAD_PARTS}
        if away:
            engine.to("device", **chosen)
        try:
            yield engine
        finally:
            if away:
                engine.to("cpu", **chosen)

    # -- steps ---------------------------------------------------------------------------------
    def forward_backward_batch(
        self, data: TensorDict, loss_function: Callable[..., Any] | None, forward_only: bool = False
    ) -> dict[str, Any]:
        """verl's ``{"model_output": {key: jagged}, "loss": [per micro-batch], "metrics": {name:
        per micro-batch values}}``, the metrics merged as verl's engines merge them
        (``append_to_dict``: a loss function's ``Metric`` becomes one ``Metric`` holding every
        micro-batch's values, a plain number a list), so that verl's ``train_mini_batch``,
        ``Metric.aggregate_dp`` and ``reduce_metrics`` aggregate them as they do its own
        engines'; ``model_output`` only when forward-only or asked for
        (``return_model_output``), as verl's engines do."""
        engine = self._initialized()
        self._check_flags(data)
        dp_group = engine.get_data_parallel_group()
        dp_size = engine.get_data_parallel_size()
        tu.assign_non_tensor(data, dp_size=dp_size)
        ids = data["input_ids"]
        if not (ids.is_nested and ids.layout == torch.jagged):
            raise BatchError("verl batches must hold jagged input_ids (pad_mode no_padding)")
        counted = _loss_mask_count(
            data.get("loss_mask") if "loss_mask" in data.keys() else None, ids
        )
        batch = TensorDict(
            {"input_ids": ids, LOSS_MASK_COUNT: counted}, batch_size=[data.batch_size[0]]
        )
        routes, record = self._routes(data, ids, forward_only)
        if routes is not None:
            batch[ROUTED_EXPERTS] = routes
        losses: dict[int, float] = {}
        metrics: dict[int, Any] = {}
        keep = forward_only or bool(_flag(data, "return_model_output", False))
        settings = self._call_settings(data)
        declared = self._declared(settings)  # the call's head (its optional outputs on or off)
        wrapped = None
        if loss_function is not None:
            wrapped = self._loss(data, loss_function, dp_group, dp_size, losses, metrics, declared)
        result = engine.forward_backward_batch(
            batch, wrapped, forward_only=forward_only, return_outputs=keep, settings=settings
        )
        if not engine.holds_outputs():
            return {"model_output": {}, "loss": [], "metrics": {}}
        output: dict[str, Any] = {}
        if keep and result["model_output"] is not None:
            output = {
                key: jagged_to_verl_layout(value, declared(key), key)
                for key, value in result["model_output"].items()
                if key != ROUTED_EXPERTS
            }
            if record:  # aligned with input_ids, as verl's megatron engine returns them
                output[ROUTED_EXPERTS] = result["model_output"][ROUTED_EXPERTS]
        merged: dict[str, Any] = {}
        for index in sorted(metrics):
            append_to_dict(merged, metrics[index])
        return {
            "model_output": output,
            "loss": [losses[index] for index in sorted(losses)],
            "metrics": merged,
        }

    def _routes(
        self, data: TensorDict, ids: torch.Tensor, forward_only: bool
    ) -> tuple[torch.Tensor | None, bool]:
        """verl's router replay for one call: ``(routes to replay, whether to return the
        recorded ones)``. With the batch flag ``enable_routing_replay`` (verl sets it for the
        actor's passes, not the reference's) the batch's ``routed_experts`` are replayed; R2's
        forward-only pass without them records them (returned as ``routed_experts``, jagged
        ``[b, tokens, layers, k]`` aligned with ``input_ids``). A rollout's routes (R3) one token
        short (none for the last generated token) get a placeholder route for it: the last
        token's output scores nothing verl reads."""
        mode = replay_mode(self.engine_config)
        if not _flag(data, "enable_routing_replay", False):
            return None, False
        if mode == "disabled":
            raise ConfigError(
                "verl batch setting enable_routing_replay=True needs engine setting "
                "router_replay.mode R2 or R3 (this engine was built without router replay)"
            )
        if ROUTED_EXPERTS in data.keys():
            return _aligned_routes(data[ROUTED_EXPERTS], ids), False
        if mode == "R2" and forward_only:
            return None, True
        raise ConfigError(
            f"verl router replay ({mode}) with enable_routing_replay: the batch has no "
            f"{ROUTED_EXPERTS!r} to replay (R2 records them in the actor's forward-only pass, R3 "
            "takes the rollout's)"
        )

    def _declared(self, settings: CallSettings) -> Callable[[str], ResultSpec]:
        """The call's head's declaration of an output key; ConfigError naming an undeclared
        one."""
        head = settings.head_of(self.engine.head)
        results = declared_results(head)

        def spec(key: str) -> ResultSpec:
            if key not in results:
                raise ConfigError(
                    f"output {key!r} is not declared by head {head.name!r} (its outputs: "
                    f"{', '.join(results)}); cannot convert it to verl's layout"
                )
            return results[key]

        return spec

    def _check_flags(self, data: TensorDict) -> None:
        pad_mode = _flag(data, "pad_mode", NO_PADDING)
        if str(getattr(pad_mode, "value", pad_mode)) != NO_PADDING:
            raise ConfigError(
                f"verl pad_mode {pad_mode!r} is not supported by the composable engine: "
                "no_padding (jagged batches) only"
            )
        for key, why in REFUSED_FLAGS.items():
            if _flag(data, key, False):
                raise ConfigError(
                    f"verl batch setting {key}=True is not supported by the composable engine: "
                    f"{why}"
                )

    def _loss(
        self,
        data: TensorDict,
        loss_function: Callable[..., Any],
        dp_group: dist.ProcessGroup | None,
        dp_size: int,
        losses: dict[int, float],
        metrics: dict[int, Any],
        declared: Callable[[str], ResultSpec],
    ) -> Callable[[Any, Any, LossContext], tuple[torch.Tensor, dict[str, float]]]:
        """The engine's loss contract around verl's loss function (see the module doc);
        ``declared``: the call's head's declaration of each output."""

        rows = _verl_rows(data)
        assigned: list[int] = []  # the batch_num_tokens last assigned (the same every micro-batch)

        def loss(
            outputs: Any, micro: Any, ctx: LossContext
        ) -> tuple[torch.Tensor, dict[str, float]]:
            assert ctx.rows is not None  # the engine's steps give them
            tokens = int(ctx.global_counts.get(LOSS_MASK_COUNT, 0.0))
            if assigned != [tokens]:
                tu.assign_non_tensor(data, batch_num_tokens=tokens)
                assigned[:] = [tokens]
            lengths = micro["attention_mask"].sum(-1)
            model_output = {
                key: to_verl_layout(value, lengths, declared(key), key)
                for key, value in outputs.items()
            }
            selected = rows.take(ctx.rows)
            device = lengths.device
            if device.type != "cpu":
                selected = selected.to(device)
            value, loss_metrics = loss_function(
                model_output=model_output, data=selected, dp_group=dp_group
            )
            losses[ctx.micro_batch_index] = float(value.detach())
            metrics[ctx.micro_batch_index] = loss_metrics
            # verl's scale for gradients averaged over ranks (x / 1 is x: no division)
            return (value / dp_size if dp_size != 1 else value), {}

        return loss

    def _call_settings(self, data: TensorDict) -> CallSettings:
        """verl's batch flags as the call's settings: the head's temperature, entropy and sum
        of squared probabilities (those the head has), and micro-batching."""
        config = self.engine.config
        options = head_options(self.engine.head)
        head: dict[str, Any] = {}
        if "temperature" in options and "temperature" in data.keys():
            head["temperature"] = _temperature(data)
        for option, flag in (
            ("compute_entropy", "calculate_entropy"),
            ("compute_sum_pi_squared", "calculate_sum_pi_squared"),
        ):
            if option in options:
                head[option] = bool(_flag(data, flag, False))
        if _flag(data, "use_dynamic_bsz", config.max_tokens_per_micro_batch is not None):
            budget = _flag(data, "max_token_len_per_gpu", config.max_tokens_per_micro_batch)
            if budget is None:
                raise ConfigError("verl use_dynamic_bsz needs max_token_len_per_gpu")
            return CallSettings(max_tokens_per_micro_batch=int(budget), head=head)
        size = _flag(data, "micro_batch_size_per_gpu", config.micro_batch_size)
        return CallSettings(micro_batch_size=int(size), head=head)

    def disable_adapter(self) -> contextlib.AbstractContextManager[Any]:
        """The LoRA adapters off (``Engine.disable_adapter``): verl's ``TrainingWorker`` enters
        it for a batch flagged ``no_lora_adapter``, its reference log-probs from the LoRA actor
        (``ref_in_actor``). ConfigError without LoRA, rather than silently the actor's own."""
        return self._initialized().disable_adapter()

    def optimizer_zero_grad(self) -> None:
        self._initialized().optimizer_zero_grad()

    def optimizer_step(self) -> float:
        return self._initialized().optimizer_step()

    def lr_scheduler_step(self) -> float:
        return self._initialized().lr_scheduler_step()

    # -- layout --------------------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        return self._initialized().get_data_parallel_rank()

    def get_data_parallel_size(self) -> int:
        return self._initialized().get_data_parallel_size()

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self._initialized().get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self) -> bool:
        return self._initialized().holds_outputs()

    # -- weights and checkpoints ---------------------------------------------------------------
    def get_per_tensor_param(
        self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs: Any
    ) -> tuple[Generator[tuple[str, torch.Tensor], None, None], Any]:
        """(Hugging Face name, full tensor) one at a time, and the PEFT config (None without
        adapters). An offloaded model is loaded for the export and offloaded again once the
        generator is exhausted (or closed).

        With LoRA, as verl's own engines hand it over: with ``model.lora.merge=True`` the
        adapters merged into their linears (no PEFT config); otherwise (verl's default) the
        adapters alone under peft's names when ``base_sync_done``, else the base model's
        weights with each adapted linear's under its LoRA wrapper's name
        (``...q_proj.base_layer.weight``, as a LoRA-enabled rollout holds it), with the PEFT
        config either way. Every tensor is exported one at a time, so ``layered_summon`` needs
        nothing of its own. Under pipeline parallelism every rank yields every stage's tensors
        (each block broadcast from the stage that holds it), as verl's engines do: verl sends
        what its first rank yields."""
        lora = self._initialized().config.lora
        adapter = self._adapters_apart()

        def whole(engine: Engine, adapter_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
            if engine.config.parallel.pipeline_parallel_size > 1:
                # every stage's tensors on every rank, as verl's engines export them
                return whole_tensors(engine.get_per_tensor_param_shard(adapter_only=adapter_only))
            return engine.get_per_tensor_param(adapter_only=adapter_only)

        def weights(engine: Engine, stack: contextlib.ExitStack) -> Iterator[tuple[str, Any]]:
            if adapter and not base_sync_done:
                assert lora is not None
                stack.enter_context(engine.disable_adapter())
                exported = whole(engine, adapter_only=False)
                return ((lora_base_name(name, lora.target_modules), t) for name, t in exported)
            return whole(engine, adapter_only=adapter and base_sync_done)

        return self._streamed(weights), (self._peft_config() if adapter else None)

    # -- verl's delta_sharded weight sync: shards, their base, the deltas ----------------------
    #: Keep the delta base in pinned host memory (verl's policy attribute; pinned only where the
    #: device is not the host).
    delta_pin_snapshots: bool = True

    def get_per_tensor_param_shard(
        self, **kwargs: Any
    ) -> tuple[Generator[tuple[str, torch.Tensor, Any], None, None], Any]:
        """This rank's block of every tensor the weight sync sends (``Engine.
        get_per_tensor_param_shard``): ``(Hugging Face name, flat block, ShardSpec)``, in one
        order on every rank, nothing gathered. The spec places the block in its Hugging Face
        tensor with verl's own vocabulary: an explicit ``BlockPlacement`` in the tensor's row
        view (rows x last dimension), the default process group as its gather group, and
        ``contributes`` False for a copy a lower rank holds too. With LoRA adapters apart
        (verl's default) the adapters and a value head's layer, with the PEFT config; merged
        LoRA is refused (every element changes each step)."""
        from verl.workers.engine.spec import BlockPlacement, ShardSpec

        adapter = self._adapters_apart()
        group = dist.group.WORLD if dist.is_initialized() else None

        def shards(engine: Engine, stack: contextlib.ExitStack) -> Iterator[tuple[str, Any, Any]]:
            for block in engine.get_per_tensor_param_shard(adapter_only=adapter):
                (first, last), (left, right) = block.rows, block.columns
                place = BlockPlacement(
                    local_shape=(last - first, right - left),
                    global_offset=(first, left),
                    full_shape=block.row_view,
                )
                spec = ShardSpec(
                    full_shape=block.shape,
                    place=place,
                    gather_group=group,
                    contributes=block.contributes,
                )
                yield block.name, block.tensor.reshape(-1), spec

        return self._streamed(shards), (self._peft_config() if adapter else None)

    def prime_delta_snapshots(self) -> None:
        """The base of the next delta: this rank's blocks as the seed sync
        (``get_per_tensor_param``) just sent them, in host memory. With LoRA adapters apart
        the seed sent the base model and no adapter, so the adapters' base is zeros: the first
        delta carries them."""
        engine = self._initialized()
        pin = self.delta_pin_snapshots and not engine.platform.memory_is_host
        self._deltas = DeltaExport(pin_memory=pin)
        adapter = self._adapters_apart()
        with self._resident(("model",)) as resident:
            blocks = resident.get_per_tensor_param_shard(adapter_only=adapter)
            self._deltas.prime(blocks, zeros=adapter)

    def get_per_tensor_param_delta_shard(
        self, **kwargs: Any
    ) -> tuple[Generator[tuple[Any, ...], None, None], Any]:
        """verl's delta export: per tensor of the shard export, in its order, ``(slots,
        dtype_str, counts, hf_idx, hf_val, gather_group)``: the one slot ``(name, shape)``, the
        elements this rank found changed since the base (int32 flat positions in the Hugging
        Face tensor, and values; none on a rank whose copy another contributes), the default
        process group. The base becomes the weights. EngineStateError before
        :meth:`prime_delta_snapshots`."""
        adapter = self._adapters_apart()
        group = dist.group.WORLD if dist.is_initialized() else None
        deltas = self._deltas

        def entries(engine: Engine, stack: contextlib.ExitStack) -> Iterator[tuple[Any, ...]]:
            for delta in deltas.deltas(engine.get_per_tensor_param_shard(adapter_only=adapter)):
                if delta.positions.numel() and int(delta.positions.max()) > INT32_MAX:
                    raise ConfigError(
                        f"{delta.name}: {list(delta.shape)} has more elements than verl's "
                        "int32 delta positions address"
                    )
                counts = torch.tensor([delta.positions.numel()], dtype=torch.int64)
                dtype = str(delta.dtype).removeprefix("torch.")
                slots = [(delta.name, delta.shape)]
                yield slots, dtype, counts, delta.positions.to(torch.int32), delta.values, group

        return self._streamed(entries), None

    def _adapters_apart(self) -> bool:
        """LoRA whose adapters sync apart from the base model (verl's ``lora.merge`` off)."""
        return self._initialized().config.lora is not None and not lora_merged(self.model_config)

    def _streamed(
        self, items: Callable[[Engine, contextlib.ExitStack], Iterator[T]]
    ) -> Generator[T, None, None]:
        """``items(engine, stack)`` as a generator that holds the model on the device (loaded
        now if offloaded) and ``stack``'s contexts until it is exhausted or closed."""
        with contextlib.ExitStack() as stack:
            engine = stack.enter_context(self._resident(("model",)))
            produced = items(engine, stack)
            held = stack.pop_all()

        def each() -> Generator[T, None, None]:
            with held:
                yield from produced

        return each()

    def _peft_config(self) -> Any:
        """The adapter's PEFT config: peft's ``LoraConfig`` (a LoRA rollout reads it as a
        dataclass), or its mapping where peft is not installed."""
        from strategies.model.peft_lora import peft_config

        engine = self.engine
        assert engine.config.lora is not None
        settings: dict[str, Any] = dict(
            peft_config(engine.config.lora, engine.config.model, head_layer=False)
        )
        try:
            import peft
        except ImportError:
            return settings
        fields = {"task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias"}
        return peft.LoraConfig(**{key: settings[key] for key in fields})

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> None:
        """This engine's checkpoint of ``global_step`` in ``local_path/global_step_<N>/`` (verl
        hands each save its own ``local_path``); ``save_contents`` with ``hf_model`` adds a
        Hugging Face export in ``local_path/huggingface/``. ``max_ckpt_to_keep`` keeps the
        newest checkpoints this process saved, removing the older ones' ``local_path``
        directories whole, as verl's own engines do (and the older steps under one reused
        ``local_path``). Offloaded parts are loaded for the save and offloaded again."""
        if hdfs_path is not None:
            raise ConfigError("ComposableEngine.save_checkpoint: hdfs_path is not supported")
        with self._resident() as engine:
            engine.save_checkpoint(
                local_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep
            )
            contents = getattr(self.checkpoint_config, "save_contents", None) or ()
            if "hf_model" in contents:  # a critic's: a token classifier, as verl's own
                engine.save_hf(os.path.join(local_path, "huggingface"))
        path = os.path.abspath(local_path)
        self._saved = [saved for saved in self._saved if saved != path] + [path]
        if max_ckpt_to_keep is not None and len(self._saved) > max_ckpt_to_keep:
            older, self._saved = self._saved[:-max_ckpt_to_keep], self._saved[-max_ckpt_to_keep:]
            if not dist.is_initialized() or dist.get_rank() == 0:
                for directory in older:
                    shutil.rmtree(directory, ignore_errors=True)

    def load_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        del_local_after_load: bool = True,
        **kwargs: Any,
    ) -> None:
        """The newest checkpoint ``save_checkpoint`` wrote under ``local_path`` (or a
        ``global_step_<N>`` directory); offloaded parts stay offloaded."""
        if hdfs_path is not None:
            raise ConfigError("ComposableEngine.load_checkpoint: hdfs_path is not supported")
        # verl's own directories are named global_step_<N> too, which the engine reads as one
        # (incomplete) checkpoint: name the newest complete one inside explicitly.
        complete = complete_checkpoints(local_path)
        with self._resident() as engine:
            engine.load_checkpoint(complete[-1][1] if complete else local_path)


def _verl_rows(data: TensorDict) -> RowSelector:
    """Rows of verl's TensorDict as ``tu.index_select_tensor_dict`` selects them (the same
    entries, values, dtypes and layouts), for the micro-batches of one call: length bounds
    recorded for rows of one dim only, and the nested tensors the batching module does not
    gather (verl's 3-D position ids: ragged in their rows' second dim) made by verl's own
    function."""
    return RowSelector(data, feature_bounds=False, other_nested=_verl_nested_rows)


def _verl_nested_rows(value: torch.Tensor, chosen: list[int]) -> torch.Tensor:
    rows = value.unbind()
    return tu.nested_tensor_from_tensor_list(
        [rows[index] for index in chosen],
        ragged_idx=getattr(value, "_ragged_idx", value.dim() - 1),
    )


def _build(head: str, backend: str, device: str, config: EngineConfig) -> Engine:
    """The Engine; where it is refused only because of ``sequence_parallel``, which verl's
    megatron config turns on by default with tensor parallelism, the error says so and how to
    turn it off."""
    try:
        return Engine.build(head=head, backend=backend, device=device, config=config)
    except ConfigError as error:
        if not config.parallel.sequence_parallel:
            raise
        plain = config.replace(parallel=attrs.evolve(config.parallel, sequence_parallel=False))
        try:
            Engine.build(head=head, backend=backend, device=device, config=plain)
        except ConfigError:
            raise error from None
        raise ConfigError(
            f"{error}. verl turns sequence_parallel on by default with tensor parallelism "
            "(megatron.sequence_parallel=True); set it to False for this engine (e.g. "
            "actor_rollout_ref.actor.megatron.sequence_parallel=False, and likewise for the "
            "reference and the critic)"
        ) from error


def _loss_mask_count(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """Jagged like ``ids``: per row as many ones as ``mask`` (verl's loss mask, jagged or
    ``[B, L]``; none: zeros) has in that row, at the row's last tokens."""
    offsets = jagged_offsets(ids)
    lengths = offsets.diff()
    counts = torch.zeros_like(lengths)
    if mask is not None and mask.is_nested:
        summed = torch.nn.functional.pad(jagged_values(mask).long().cumsum(0), (1, 0))
        bounds = jagged_offsets(mask)
        counts = summed[bounds[1:]] - summed[bounds[:-1]]
    elif mask is not None:
        counts = mask.long().sum(-1)
    total = int(offsets[-1])
    # each token's place from its row's end: 1 for the last
    from_end = torch.repeat_interleave(offsets[1:], lengths, output_size=total) - torch.arange(
        total
    )
    ones = from_end <= torch.repeat_interleave(counts, lengths, output_size=total)
    return jagged_view(ones.float(), offsets)


def _aligned_routes(routes: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """verl's ``routed_experts`` (jagged ``[b, tokens, layers, k]``) one route per input token:
    a row one short gets the placeholder route ``0..k-1`` for its last token (whose output
    scores nothing verl reads), and so do the trailing all-zero routes verl's agent loop fills
    in for tokens the rollout did not route (with ``k > 1``: a real route names ``k`` distinct
    experts). ConfigError naming the field for anything else."""
    if not (isinstance(routes, torch.Tensor) and routes.is_nested):
        raise ConfigError(f"verl's {ROUTED_EXPERTS!r} must be jagged [b, tokens, layers, k]")
    route_rows = list(routes.unbind())
    lengths = jagged_offsets(ids).diff().tolist()
    if len(route_rows) != len(lengths):
        raise ConfigError(
            f"verl's {ROUTED_EXPERTS!r} has {len(route_rows)} rows for {len(lengths)} sequences"
        )
    aligned = []
    for index, (row, length) in enumerate(zip(route_rows, lengths, strict=True)):
        if row.dim() != 3:
            raise ConfigError(
                f"verl's {ROUTED_EXPERTS!r} must be [b, tokens, layers, k]; row {index} has "
                f"shape {tuple(row.shape)}"
            )
        k = row.shape[2]
        placeholder = torch.arange(k, dtype=row.dtype, device=row.device)
        if row.shape[0] == length - 1:
            row = torch.cat([row, placeholder.expand(1, row.shape[1], k)])
        elif row.shape[0] == length and k > 1:
            routed = (row != 0).flatten(1).any(-1)
            recorded = int(routed.nonzero().max()) + 1 if bool(routed.any()) else 0
            if recorded < length:
                row = row.clone()
                row[recorded:] = placeholder
        elif row.shape[0] != length:
            raise ConfigError(
                f"verl's {ROUTED_EXPERTS!r} row {index} has {row.shape[0]} routes for {length} "
                "tokens (one per token, or one short: none for the last generated token)"
            )
        aligned.append(row.to(torch.int64))
    return torch.nested.nested_tensor(aligned, layout=torch.jagged)


def _temperature(data: TensorDict) -> float:
    """verl's temperature: one number, or a per-sequence tensor that must hold one value."""
    value = data["temperature"]
    if isinstance(value, torch.Tensor):
        if value.numel() == 0 or not bool((value == value.flatten()[0]).all()):
            raise ConfigError(
                "verl per-sequence temperatures that differ are not supported by the composable "
                "engine: one temperature per batch"
            )
        return float(value.flatten()[0])
    return float(value)


def register_cells() -> None:
    """:class:`ComposableEngine` in verl's engine registry for every cell (idempotent)."""
    from verl.workers.engine.base import EngineRegistry

    for cell in registered_cells():
        known = EngineRegistry._engines.get(cell.model_type, {}).get(cell.backend, {})
        if known.get(cell.key) is ComposableEngine:
            continue
        EngineRegistry.register(
            model_type=cell.model_type,
            backend=cell.backend,
            device=cell.device,
            vendor=cell.vendor,
        )(ComposableEngine)


register_cells()  # where this module was imported before verl, verl's plug-in left it to here
