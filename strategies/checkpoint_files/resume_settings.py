"""Resuming with this engine's optimizer and LR-schedule settings, for every backend.

A checkpoint gives the optimizer its state (Adam moments, step counts) and the schedule its step
count, nothing else: the settings (lr, min_lr, weight decay, betas, eps, the schedule's style,
warmup and decay steps) are always this engine's config. Settings changed between runs are so
honoured from the resumed step on, never blended with the saved ones, and a run resumed with
the same settings is the run that was saved. A checkpoint without that state (a forward-only
engine's, weights only) restarts them as a new engine's (:class:`OptimizerResume`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import attrs

#: Param-group entries that are state, not settings (megatron's distributed optimizer keeps
#: Adam's step count in its groups): a checkpoint's are kept.
_GROUP_STATE = ("params", "step")


class GroupedOptimizer(Protocol):
    """A torch optimizer, or a megatron one (whose param groups are its inner optimizer's)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class SteppedSchedule(Protocol):
    """An LR schedule positioned by a step count (megatron's ``OptimizerParamScheduler``, the
    fsdp2 backend's ``LRSchedule``); ``step`` sets the optimizer's lr and weight decay."""

    num_steps: int

    def step(self, increment: int) -> Any: ...


@contextlib.contextmanager
def keeping_settings(optimizers: Iterable[GroupedOptimizer]) -> Iterator[None]:
    """Load a checkpoint's optimizer state inside; on exit every param group has this
    optimizer's settings again (``load_state_dict`` also takes the saved groups' settings)."""
    optimizers = list(optimizers)
    settings = [
        [{k: v for k, v in group.items() if k not in _GROUP_STATE} for group in opt.param_groups]
        for opt in optimizers
    ]
    yield
    for optimizer, own in zip(optimizers, settings, strict=True):
        for group, group_settings in zip(optimizer.param_groups, own, strict=True):
            group.update(group_settings)


def saved_schedule_step(path: str) -> int:
    """The step count in a checkpoint's schedule file (what resuming takes from it)."""
    with open(path) as handle:
        return int(json.load(handle)["num_steps"])


def set_schedule_step(schedule: SteppedSchedule, steps: int) -> None:
    """``schedule``, with this engine's settings, at ``steps``: the optimizer's lr and weight
    decay become those a fresh run's schedule gives at that step."""
    schedule.num_steps = steps
    schedule.step(0)


#: A backend's optimizer type (a torch optimizer, or megatron's).
OptimizerT = TypeVar("OptimizerT")


@attrs.frozen
class OptimizerResume(Generic[OptimizerT]):
    """What one checkpoint load does to this engine's optimizer and LR schedule, for every
    backend: a checkpoint that holds their state (its schedule file) resumes them; one without
    (a forward-only engine's: weights only) restarts them as a new engine's, the optimizer with
    no state over the loaded weights and the schedule at step 0."""

    schedule_path: str
    #: This engine's optimizer and schedule (None for a forward-only engine).
    optimizer: OptimizerT | None
    schedule: SteppedSchedule | None
    #: Whether the checkpoint holds the optimizer's and the schedule's state.
    resumes: bool

    @classmethod
    def at(
        cls, schedule_path: str, optimizer: OptimizerT | None, schedule: SteppedSchedule | None
    ) -> OptimizerResume[OptimizerT]:
        return cls(schedule_path, optimizer, schedule, os.path.exists(schedule_path))

    @property
    def loaded_optimizer(self) -> OptimizerT | None:
        """The optimizer the checkpoint's state loads into (None: load the weights only)."""
        return self.optimizer if self.resumes else None

    def finish(self, restart_optimizer: Callable[[OptimizerT], None]) -> None:
        """After the load: the schedule at the saved step; or, restarting, the optimizer
        restarted by the backend's ``restart_optimizer`` and the schedule at step 0."""
        if not self.resumes and self.optimizer is not None:
            restart_optimizer(self.optimizer)
        if self.schedule is not None:
            steps = saved_schedule_step(self.schedule_path) if self.resumes else 0
            set_schedule_step(self.schedule, steps)
