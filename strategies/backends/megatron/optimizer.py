"""Megatron optimizer (AdamW, clipping, optional distributed optimizer) and LR schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from heads.errors import ConfigError
from strategies.part_configs import PartsConfig

#: megatron ``OptimizerConfig`` fields a backend's ``optimizer_overrides`` may set, each with
#: the values it takes: CPU optimizer offload (the optimizer state and step, or a fraction of
#: it, in host memory) and the precision-aware optimizer.
OPTIMIZER_OVERRIDES: dict[str, tuple[type, ...]] = {
    "optimizer_cpu_offload": (bool,),
    "optimizer_offload_fraction": (int, float),
    "overlap_cpu_optimizer_d2h_h2d": (bool,),
    "use_precision_aware_optimizer": (bool,),
}


def check_optimizer_overrides(overrides: dict[str, Any], distributed: bool) -> None:
    """ConfigError naming each unknown field or bad value; both features need the distributed
    optimizer, as megatron's own arguments require."""
    for name, value in overrides.items():
        kinds = OPTIMIZER_OVERRIDES.get(name)
        if kinds is None:
            raise ConfigError(
                f"optimizer_overrides: unknown megatron OptimizerConfig field {name!r} (known: "
                f"{', '.join(OPTIMIZER_OVERRIDES)})"
            )
        if not isinstance(value, kinds) or (kinds != (bool,) and isinstance(value, bool)):
            kind = kinds[-1].__name__
            raise ConfigError(f"optimizer_overrides: {name}={value!r} must be a {kind}")
    fraction = overrides.get("optimizer_offload_fraction", 0.0)
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(
            f"optimizer_overrides: optimizer_offload_fraction={fraction} must be in [0, 1]"
        )
    for name in ("optimizer_cpu_offload", "use_precision_aware_optimizer"):
        if overrides.get(name) and not distributed:
            raise ConfigError(
                f"optimizer_overrides: {name}=True needs use_distributed_optimizer=True "
                "(megatron offloads and keeps low-precision state only for the distributed "
                "optimizer)"
            )


def optimizer_overrides_on(memory_is_host: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    """What of ``overrides`` megatron is given on a platform whose device memory is the host's
    (``memory_is_host``: the CPU platform) or not. On the host, none: the optimizer state and
    step are in host memory already (megatron's offloading optimizer asks for CUDA streams),
    and the precision-aware optimizer with its default float32 master weights and moments is
    the AdamW the engine runs. Elsewhere all; the precision-aware optimizer needs
    TransformerEngine (megatron 0.16 reads its version for the setting, and uses its fused
    Adam without offload)."""
    if memory_is_host:
        return {}
    if overrides.get("use_precision_aware_optimizer"):
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError(
                "optimizer_overrides: use_precision_aware_optimizer=True needs "
                "TransformerEngine, which is not installed"
            )
    return dict(overrides)


def build_optimizer(
    config: PartsConfig,
    chunks: list[torch.nn.Module],
    *,
    distributed: bool,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """``get_megatron_optimizer`` for the DDP-wrapped model chunks (``distributed``: shard the
    optimizer state over data-parallel ranks; ``overrides``: more ``OptimizerConfig`` fields)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt = config.optimizer
    bf16 = config.dtype == "bfloat16"
    megatron_config = OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        use_distributed_optimizer=distributed,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        **(overrides or {}),
    )
    return get_megatron_optimizer(megatron_config, chunks)


def build_scheduler(config: PartsConfig, optimizer: Any) -> Any:
    """Linear warmup then constant / linear / cosine decay to ``min_lr``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt, schedule = config.optimizer, config.scheduler
    decay_steps = schedule.resolved_decay_steps(config.total_steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if schedule.warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=schedule.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=schedule.decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )


def step_with_grad_norm(optimizer: Any, grad_norm: float) -> None:
    """Megatron's ``optimizer.step()`` for gradients already prepared (``prepare_grads``) and
    measured (``get_grad_norm``, giving ``grad_norm``), as the backend's ``grad_norm`` does:
    clip by that norm where ``clip_grad > 0`` and step, without measuring the norm again.

    The same work as megatron 0.16's ``ChainedOptimizer.step`` (and, for one optimizer,
    ``FP32Optimizer`` / ``MixedPrecisionOptimizer.step``) after its norm; zero counting is
    never asked for here (``log_num_zeros_in_grad`` stays off).
    """
    from megatron.core.optimizer import ChainedOptimizer, clip_grads

    chained = isinstance(optimizer, ChainedOptimizer)
    for part in optimizer.chained_optimizers if chained else [optimizer]:
        if getattr(part, "is_stub_optimizer", False):  # a rank holding none of its parameters
            continue
        parameters = part.get_parameters()
        if part.config.clip_grad > 0.0 and parameters:
            clip_grads.clip_grad_by_total_norm_fp32(
                parameters,
                max_norm=part.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    optimizer.step_with_ready_grads()


def grad_norm_parts(
    optimizer: Any, device: torch.device
) -> tuple[list[torch.Tensor], Callable[[list[float]], float]]:
    """Megatron 0.16's ``optimizer.get_grad_norm()`` (gradients already prepared) split at its
    host transfer: per norm it would measure, the squared L2 norm as a one-element tensor on
    ``device`` (all-reduced over that optimizer's gradient-statistics group, as megatron does),
    and the function that turns their host values into exactly the float megatron returns.

    Megatron converts each norm with ``.item()`` (and its fallback L2 kernel, without
    TransformerEngine or Apex, converts every gradient's norm); here nothing waits for the
    device, so the engine can fetch the norm with the step's other numbers."""
    from megatron.core.optimizer import ChainedOptimizer

    parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else []
    if not parts or len(parts) == 1 or optimizer.grads_states_parallel_group_is_shared():
        grads = [g for part in parts or [optimizer] for g in part.get_main_grads_for_grad_norm()]
        group = (parts[0] if parts else optimizer).get_grad_stats_parallel_group()
        squares = [_squared_norm(grads, group, device)]
    else:
        squares = [
            _squared_norm(
                part.get_main_grads_for_grad_norm(), part.get_grad_stats_parallel_group(), device
            )
            for part in parts
        ]

    def finish(values: list[float]) -> float:
        norms = [value ** (1.0 / 2.0) for value in values]
        if len(norms) == 1:
            return norms[0]
        return math.sqrt(sum(norm**2 for norm in norms))

    return squares, finish


def _squared_norm(grads: list[torch.Tensor], group: Any, device: torch.device) -> torch.Tensor:
    """``get_grad_norm_fp32``'s L2 branch up to (not including) its ``.item()``."""
    import torch.distributed as dist
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm, to_local_if_dtensor

    grads = [to_local_if_dtensor(grad) for grad in grads]
    if not grads:
        norm = torch.zeros(1, dtype=torch.float, device=device)
    elif clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        # megatron's fallback kernel, without its host round trips: the same norms, stacked
        norm = torch.norm(torch.stack([torch.norm(grad) for grad in grads])).reshape(1)
    else:  # TransformerEngine's or Apex's fused kernel, as megatron calls it
        overflow = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads], False)
    total = norm.to(device=device, dtype=torch.float) ** 2.0
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total
