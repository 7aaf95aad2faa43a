"""megatron-core CPU compatibility layer (CPU-only torch, gloo; megatron-core in the range of
:mod:`strategies.megatron_support.version`)."""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar, cast

import torch
from torch.overrides import TorchFunctionMode

from strategies.megatron_support.imports import import_megatron
from strategies.megatron_support.version import check_megatron_version

_F = TypeVar("_F", bound=Callable[..., Any])
_CPU = torch.device("cpu")
_MARK = "_megatron_cpu_wrapped"
_state: dict[str, Any] = {"enabled": False, "n_modules": -1}


def _is_cuda(device: object) -> bool:
    """True for anything megatron uses to name a CUDA device ("cuda", "cuda:0", 0, device)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaAsCpuMode(TorchFunctionMode):
    """Maps cuda devices to cpu, makes Tensor.cuda() a no-op, reports cuda type strings."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:  # megatron compares x.type() to cuda names
                name: str = func(args[0])
                return name if name.startswith("torch.cuda.") else "torch.cuda." + name[6:]
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
        elif func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if _is_cuda(kwargs.get("device")) or kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = _CPU
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _mode_active() -> bool:
    """Whether our mode is anywhere on the torch-function mode stack (no double push)."""
    stack = range(torch._C._len_torch_function_stack())
    return any(isinstance(torch._C._get_function_stack_at(i), _CudaAsCpuMode) for i in stack)


@contextlib.contextmanager
def megatron_cpu_scope() -> Iterator[None]:
    """Run a block with cuda->cpu device mapping (re-entrant; cheap when already active)."""
    if _state["enabled"] and len(sys.modules) != _state["n_modules"]:
        _install_torch_view()  # megatron modules imported since enable() also get the view
    if _mode_active():
        yield
    else:
        with _CudaAsCpuMode():
            yield


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    """Pop our mode while model compute runs: it costs ~10-15% on model fwd+bwd."""
    n = torch._C._len_torch_function_stack()
    top = torch._C._get_function_stack_at(n - 1) if n else None
    if not isinstance(top, _CudaAsCpuMode):
        yield
        return
    torch._C._pop_torch_function_stack()
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(top)


class _Wrapper(Protocol):
    """A function wrapper that keeps the type of what it wraps."""

    def __call__(self, fn: _F, /) -> _F: ...


def _idempotent(wrap: _Wrapper) -> _Wrapper:
    """Hand back a function ``wrap`` already wrapped, so that enable() can run again and a
    forward step handed to nested schedules is wrapped once."""

    def once(fn: _F) -> _F:
        if getattr(fn, _MARK, None) is once:
            return fn
        wrapped = wrap(fn)
        setattr(wrapped, _MARK, once)
        return wrapped

    functools.update_wrapper(once, wrap)
    return once


@_idempotent
def run_scoped(fn: _F) -> _F:
    """``fn`` under the mode: megatron code with hard-coded cuda devices and type strings."""

    @functools.wraps(fn)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with megatron_cpu_scope():
            return fn(*args, **kwargs)

    return cast("_F", scoped)


@_idempotent
def run_unscoped(fn: _F) -> _F:
    """``fn`` without the mode: model compute, which needs no mapping and would pay for it."""

    @functools.wraps(fn)
    def unscoped(*args: Any, **kwargs: Any) -> Any:
        with _suspended():
            return fn(*args, **kwargs)

    return cast("_F", unscoped)


@_idempotent
def run_forward_step(fn: _F) -> _F:
    """A schedule's forward step: it and the loss function it returns run without the mode."""

    @functools.wraps(fn)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        with _suspended():
            output, loss_func = fn(*args, **kwargs)
        return output, run_unscoped(loss_func)

    return cast("_F", forward_step)


@_idempotent
def run_schedule(fn: _F) -> _F:
    """A forward_backward function: under the mode, except the forward step it is handed."""

    @functools.wraps(fn)
    def schedule(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("forward_step_func") is not None:
            kwargs["forward_step_func"] = run_forward_step(kwargs["forward_step_func"])
        with megatron_cpu_scope():
            return fn(*args, **kwargs)

    return cast("_F", schedule)


class _CudaView(types.ModuleType):
    """torch.cuda as megatron modules see it: current device is the CPU, RNG is the CPU one."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.current_device = lambda: _CPU
        self.synchronize = self.empty_cache = lambda *a, **k: None  # nothing to wait for / free
        self.manual_seed = torch.manual_seed
        self.get_rng_state = lambda device="cuda": torch.get_rng_state()
        self.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchView(types.ModuleType):
    """Stands in for `torch` in megatron module globals only; plain torch stays untouched."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaView()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        setattr(self, name, value)  # cached: a miss costs ~1.7us, megatron does ~240 per step
        return value


_TORCH_VIEW = _TorchView()


def _install_torch_view() -> None:
    """Point every loaded megatron.core module's `torch` global at the view."""
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _TORCH_VIEW  # type: ignore[attr-defined]
    _state["n_modules"] = len(sys.modules)


def _cpu_tracker_class(base: Any) -> type:
    """CudaRNGStatesTracker whose named streams are CPU-generator states (swapped on fork)."""

    class CpuRNGStatesTracker(base):  # type: ignore[misc, unused-ignore]
        """Same bookkeeping as megatron's tracker; the default CPU generator plays the GPU's."""

        _current_state_name: str

        # add() is inherited: through the torch view it seeds and snapshots the CPU generator.
        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            """Swap the CPU generator state; megatron's fork warns whenever the CPU one moves."""
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state, orig_name = torch.get_rng_state(), self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    setattr(CpuRNGStatesTracker, _MARK, True)
    return CpuRNGStatesTracker


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """megatron's version hard-codes device="cuda"; used when attention_mask is None."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """Same as megatron's, on CPU."""
    mu = torch.triu(torch.ones(sq, skv, dtype=torch.bool), diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _wrap_methods(cls: type, names: tuple[str, ...]) -> None:
    """Scope the methods a class defines itself (inherited ones are wrapped on their owner)."""
    for name in names:
        if name in vars(cls):
            setattr(cls, name, run_scoped(vars(cls)[name]))


_OPTIMIZER_METHODS = (
    "__init__", "step", "prepare_grads", "step_with_ready_grads", "get_grad_norm",
    "clip_grad_norm", "count_zeros", "state_dict", "load_state_dict", "sharded_state_dict",
    "reload_model_params", "save_parameter_state", "load_parameter_state",
    "offload_to_cpu", "restore_from_cpu",
)  # fmt: skip


def enable_megatron_cpu_compat() -> None:
    """Install the CPU layer into megatron-core (process-global, idempotent).

    Megatron modules imported later get the torch view on the next scoped call or the next
    enable() call; call it again after importing other megatron model families.
    """
    if _state["enabled"]:
        _install_torch_view()
        return
    check_megatron_version("the megatron-core CPU compatibility layer")
    names = (  # imported up front so that their `torch` global gets the view now
        "tensor_parallel", "tensor_parallel.random", "tensor_parallel.data",
        "transformer.utils", "fusions.fused_softmax", "pipeline_parallel.schedules",
        "optimizer", "optimizer.optimizer", "optimizer.distrib_optimizer", "optimizer.clip_grads",
        "models.common.language_module.language_module", "models.gpt.gpt_model",
        "distributed", "dist_checkpointing", "dist_checkpointing.serialization",
        "dist_checkpointing.strategies.torch", "dist_checkpointing.strategies.fully_parallel",
        "dist_checkpointing.exchange_utils", "dist_checkpointing.tensor_aware_state_dict",
        "transformer.moe.moe_utils", "transformer.moe.router", "transformer.moe.experts",
        "transformer.moe.token_dispatcher", "transformer.moe.moe_layer",
        "models.common.embeddings.rope_utils",
        "models.common.embeddings.rotary_pos_embedding",
    )  # fmt: skip
    mod: dict[str, Any] = import_megatron(*names)
    _install_torch_view()

    rnd = mod["tensor_parallel.random"]
    # recompute (CheckpointFunction) saves/restores "the cuda" state: on CPU, the CPU generator
    rnd._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    rnd._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    if not getattr(rnd.CudaRNGStatesTracker, _MARK, False):
        rnd.CudaRNGStatesTracker = _cpu_tracker_class(rnd.CudaRNGStatesTracker)
        rnd._CUDA_RNG_STATE_TRACKER = None  # rebuilt lazily from the CPU class
        rnd._CUDA_RNG_STATE_TRACKER_INITIALIZED = False

    for name in ("transformer.utils", "fusions.fused_softmax"):
        mod[name].get_default_causal_mask = _cpu_causal_mask
        mod[name].get_sliding_window_causal_mask = _cpu_sliding_window_mask

    sched = mod["pipeline_parallel.schedules"]
    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        setattr(sched, name, run_schedule(getattr(sched, name)))
    sched.backward_step = run_unscoped(sched.backward_step)

    opt, dopt = mod["optimizer.optimizer"], mod["optimizer.distrib_optimizer"]
    for cls in (
        opt.MegatronOptimizer, opt.MixedPrecisionOptimizer, opt.Float16OptimizerWithFloat16Params,
        opt.FP32Optimizer, opt.ChainedOptimizer, dopt.DistributedOptimizer,
    ):  # fmt: skip
        _wrap_methods(cls, _OPTIMIZER_METHODS)
    clip = mod["optimizer.clip_grads"]  # the megatron backend clips by a norm it measured
    clip.clip_grad_by_total_norm_fp32 = run_scoped(clip.clip_grad_by_total_norm_fp32)
    opt_pkg = mod["optimizer"]
    opt_pkg.get_megatron_optimizer = run_scoped(opt_pkg.get_megatron_optimizer)
    lm = mod["models.common.language_module.language_module"].LanguageModule
    _wrap_methods(lm, ("setup_embeddings_and_output_layer",))
    for name in ("tensor_parallel", "tensor_parallel.data"):
        mod[name].broadcast_data = run_scoped(mod[name].broadcast_data)
    for name in ("dist_checkpointing", "dist_checkpointing.serialization"):
        for fn in ("save", "load"):
            setattr(mod[name], fn, run_scoped(getattr(mod[name], fn)))
    # context parallelism: the rotary embedding's part of each rank (pinned host indices)
    rope = run_scoped(mod["models.common.embeddings.rope_utils"].get_pos_emb_on_this_cp_rank)
    for name in (
        "models.common.embeddings.rope_utils",
        "models.common.embeddings.rotary_pos_embedding",
    ):
        mod[name].get_pos_emb_on_this_cp_rank = rope
    _enable_moe(mod["transformer.moe.moe_utils"], mod["transformer.moe.token_dispatcher"])
    _state["enabled"] = True


class _HostStream:
    """Stands in for the CUDA stream megatron's all-to-all dispatcher copies split sizes on."""


def _enable_moe(moe_utils: Any, dispatcher: Any) -> None:
    """Mixture-of-experts layers on CPU: the router's gating GEMM falls back to torch (the
    module reads ``te_general_gemm``, defined only when TransformerEngine imports), and the
    all-to-all dispatcher takes its split sizes as host lists without a side stream."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    alltoall = dispatcher.MoEAlltoAllTokenDispatcher
    alltoall.cuda_dtoh_stream = _HostStream()  # __init__ creates a torch.cuda.Stream otherwise
    alltoall._maybe_dtoh_and_synchronize = _host_splits


def _host_splits(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
    """The dispatcher's device-to-host step on CPU: nothing to copy or wait for, but gloo's
    ``all_to_all_single`` takes split sizes as lists of ints."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits"):  # the all-to-all's; the rest stay
            value = getattr(self, name, None)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.tolist())
    return tokens_per_expert
