"""AdamW, the LR schedule and global-norm gradient clipping, with megatron's semantics.

As ``get_megatron_optimizer`` does, biases and 1-D parameters (norms) get no weight decay, and
the schedule (``megatron.core.optimizer_param_scheduler``'s) is a linear warmup from 0 then
constant, linear or cosine decay to ``min_lr`` over ``decay_steps`` (warmup included), setting
every group's ``lr`` and ``weight_decay`` (times its ``wd_mult``) at each step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import attrs
import torch

from strategies.backends.fsdp2.sharding import on_mesh_device
from strategies.part_configs import PartsConfig


def build_optimizer(config: PartsConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW over the (sharded) parameters: one group with weight decay, one without."""
    opt = config.optimizer
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
    groups = [
        {"params": params, "wd_mult": mult}
        for params, mult in ((decay, 1.0), (no_decay, 0.0))
        if params
    ]
    return torch.optim.AdamW(
        groups,
        lr=opt.lr,
        betas=(opt.adam_beta1, opt.adam_beta2),
        eps=opt.adam_eps,
        weight_decay=opt.weight_decay,
    )


@attrs.define(kw_only=True)
class LRSchedule:
    """Warmup, then constant / linear / cosine decay; ``step`` sets the optimizer's groups."""

    optimizer: torch.optim.Optimizer
    init_lr: float
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str
    weight_decay: float
    num_steps: int = 0

    @classmethod
    def from_config(cls, config: PartsConfig, optimizer: torch.optim.Optimizer) -> LRSchedule:
        opt, schedule = config.optimizer, config.scheduler
        decay_steps = schedule.resolved_decay_steps(config.total_steps)
        built = cls(
            optimizer=optimizer,
            init_lr=0.0 if schedule.warmup_steps else opt.lr,
            max_lr=opt.lr,
            min_lr=opt.min_lr,
            warmup_steps=schedule.warmup_steps,
            decay_steps=decay_steps,
            decay_style=schedule.decay_style,
            weight_decay=opt.weight_decay,
        )
        built.step(0)
        return built

    def lr(self) -> float:
        """The learning rate at ``num_steps``."""
        steps = self.num_steps
        if self.warmup_steps > 0 and steps <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * steps / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if steps > self.decay_steps:
            return self.min_lr
        ratio = (steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> float:
        """Advance ``increment`` steps; set every group's lr and weight decay; return the lr."""
        self.num_steps += increment
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)
        return lr

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings (a record) and the step count (all a resume takes, see
        ``strategies.checkpoint_files.resume_settings``)."""
        return attrs.asdict(self, filter=lambda field, _: field.name != "optimizer")


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """The global L2 norm of the gradients (over every shard of every rank); 0.0 without any."""
    total = gradient_norm_tensor(parameters)
    return 0.0 if total is None else float(total)


def gradient_norm_tensor(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """:func:`gradient_norm` left on the device (None without any gradient)."""
    from torch.distributed.tensor import DTensor

    grads = [param.grad for param in parameters if param.grad is not None]
    if not grads:
        return None
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = on_mesh_device(total).full_tensor()
    return total


def clip_gradients(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, grad_norm: float
) -> None:
    """With ``max_norm > 0``, scale the gradients by ``max_norm / (grad_norm + 1e-6)`` where that
    is below 1; ``grad_norm`` is their :func:`gradient_norm`, so it is not measured again."""
    params = [param for param in parameters if param.grad is not None]
    if max_norm <= 0 or not params:
        return
    # clip_grads_with_norm_'s factor, worked out on the host in the gradients' dtype (as it does
    # on the device) from the norm already read: no host-to-device copy of the norm
    grad = cast(torch.Tensor, params[0].grad)
    factor = (max_norm / (torch.tensor(grad_norm, dtype=grad.dtype) + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([cast(torch.Tensor, p.grad) for p in params], float(factor))


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give never-stepped parameters the zero AdamW state their first step starts from, so a
    checkpoint always holds every state tensor (and reading the state changes nothing)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param].update(
                    step=torch.tensor(0.0),
                    exp_avg=torch.zeros_like(param, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(param, memory_format=torch.preserve_format),
                )
