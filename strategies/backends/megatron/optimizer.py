"""Megatron optimizer (AdamW, clipping, optional distributed optimizer) and LR schedule."""

from __future__ import annotations

from typing import Any

import torch

from strategies.config import PartsConfig


def build_optimizer(
    config: PartsConfig, chunks: list[torch.nn.Module], *, distributed: bool
) -> Any:
    """``get_megatron_optimizer`` for the DDP-wrapped model chunks (``distributed``: shard the
    optimizer state over data-parallel ranks)."""
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
