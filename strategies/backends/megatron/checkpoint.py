"""Megatron backend state in a checkpoint directory: model and optimizer through megatron's
``dist_checkpointing`` (torch_dist format, so a checkpoint saved at one TP/PP layout loads at
another), the LR schedule as JSON, this rank's RNG streams as a small tensor-only file.

Collective: every rank calls ``save_state`` / ``load_state`` with the same directory.
"""

from __future__ import annotations

import json
import os
import queue
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from heads.errors import CheckpointError
from strategies.checkpoint_files.publish import FileChecksums
from strategies.checkpoint_files.resume_settings import OptimizerResume, keeping_settings
from strategies.checkpoint_files.rng_states import rng_states, set_rng_states
from strategies.parallel.collectives import barrier, rank

if TYPE_CHECKING:
    from strategies.backends.megatron.checkpoint_writer import ChecksummingSaveStrategy

MODEL_DIR = "dist"
SCHEDULER_FILE = "scheduler.json"
RNG_DIR = "rng"
#: The distributed optimizer's only sharding type that round-trips with the torch AdamW
#: fallback in megatron-core 0.16.1 (the default ``fully_sharded_model_space`` fails at save,
#: "flattened_range is not supported"; ``dp_reshardable`` fails at load with an in-place op on
#: a leaf view); ignored by the plain optimizer.
_OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}


def _use_in_process_results_queue() -> None:
    """Give megatron's checkpoint writer a fresh in-process results queue for this save (through
    which the write step hands its results to megatron's finalisation).

    Megatron makes it a ``Manager().Queue()``: a helper process, spawned (which re-imports the
    user's ``__main__``, running a script without an ``if __name__ == "__main__":`` guard
    again) and outliving a SIGKILLed parent. The write step here runs in this process
    (``ChecksummingSaveStrategy``), so a thread-safe queue is all it needs, and a save starts no
    process. (An earlier version forked a Manager from the saving process instead; that process
    runs gloo's and the store's threads, so a fork there can leave the child waiting on a lock
    one of them held.) A fresh queue per save: a failed save's result is never read by the
    next one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()


def save_state(
    chunks: Sequence[torch.nn.Module], optimizer: Any, scheduler: Any, directory: str
) -> FileChecksums:
    """Write the model ``chunks`` (the unwrapped modules), ``optimizer`` and ``scheduler``
    (None for a forward-only engine) and this rank's RNG states under ``directory``. Returns
    the size and checksum of the files this rank checksummed while writing them."""
    from strategies.backends.megatron.checkpoint_writer import ChecksummingSaveStrategy

    strategy = ChecksummingSaveStrategy()
    _save(chunks, optimizer, scheduler, directory, strategy)
    return _model_checksums(strategy.checksums)


def stage_state(
    chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    directory: str,
    buffers: dict[Any, torch.Tensor],
) -> StagedModelSave:
    """``save_state`` up to the model files: planned (collective), the tensors copied out of
    the model and optimizer into ``buffers`` (host memory kept between saves), the LR schedule
    and RNG states written; the model files are left to the returned save."""
    from strategies.backends.megatron.checkpoint_writer import ChecksummingSaveStrategy

    strategy = ChecksummingSaveStrategy(staging_buffers=buffers)
    _save(chunks, optimizer, scheduler, directory, strategy)
    return StagedModelSave(strategy)


@attrs.frozen
class StagedModelSave:
    """The model files of a staged save (``strategies.backends.base.StagedSave``)."""

    strategy: ChecksummingSaveStrategy

    def write(self) -> tuple[FileChecksums, Any]:
        results = self.strategy.write_staged()
        return _model_checksums(self.strategy.checksums), results

    def finish(self, parts: Sequence[Any]) -> None:
        self.strategy.finish_staged(parts)


def _save(
    chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    directory: str,
    strategy: ChecksummingSaveStrategy,
) -> None:
    from megatron.core import dist_checkpointing

    model_dir = os.path.join(directory, MODEL_DIR)
    if rank() == 0:
        os.makedirs(model_dir, exist_ok=True)
        os.makedirs(os.path.join(directory, RNG_DIR), exist_ok=True)
    barrier()
    if optimizer is not None:
        _materialize_optimizer_state(optimizer)
    state = _sharded_state(chunks, optimizer, loading=False)
    _use_in_process_results_queue()
    dist_checkpointing.save(
        state, model_dir, sharded_strategy=strategy, async_sharded_save=strategy.staged
    )
    if rank() == 0 and scheduler is not None:
        with open(os.path.join(directory, SCHEDULER_FILE), "w") as handle:
            json.dump(scheduler.state_dict(), handle)
    torch.save(_rng_states(), os.path.join(directory, RNG_DIR, f"rank_{rank()}.pt"))


def _model_checksums(checksums: FileChecksums) -> FileChecksums:
    return {f"{MODEL_DIR}/{name}": entry for name, entry in checksums.items()}


def load_state(
    chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    directory: str,
    *,
    same_layout: bool,
) -> None:
    """Restore what ``save_state`` wrote. Model and optimizer reshard to this layout
    (``dist_checkpointing``); per-rank RNG streams are restored only at the same layout (at
    another one there is no rank to take them from). The optimizer and LR schedule keep this
    engine's settings (``strategies.checkpoint_files.resume_settings``). A forward-only engine's
    checkpoint (no optimizer or scheduler state) leaves this engine's optimizer and LR schedule as a
    new engine's, starting from the loaded weights."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from strategies.backends.megatron.checkpoint_reader import MappedLoadStrategy

    resume = OptimizerResume.at(os.path.join(directory, SCHEDULER_FILE), optimizer, scheduler)
    optimizer = resume.loaded_optimizer
    with torch.no_grad():
        if optimizer is not None:
            _materialize_optimizer_state(optimizer)
        template = _sharded_state(chunks, optimizer, loading=True)
        try:
            # Checked against the checkpoint's index before anything loads: a checkpoint of
            # another dtype or optimizer would otherwise fail halfway, the weights replaced.
            # Where either side has no optimizer, the checkpoint may hold more than is asked.
            strict = "raise_all" if optimizer is not None else "raise_unexpected"
            loaded = dist_checkpointing.load(
                template,
                os.path.join(directory, MODEL_DIR),
                sharded_strategy=MappedLoadStrategy(),
                strict=strict,
            )
        except CheckpointingException as error:
            raise CheckpointError(
                f"checkpoint {directory} does not hold this engine's state (saved with another "
                f"dtype or optimizer?): {str(error)[:2000]}"
            ) from error
        for key, chunk in zip(_model_keys(chunks), chunks, strict=True):
            chunk.load_state_dict(loaded[key])
        if optimizer is not None:
            with keeping_settings(getattr(optimizer, "chained_optimizers", [optimizer])):
                _load_optimizer(optimizer, loaded["optimizer"])
    # the schedule's step count set, not megatron's load_state_dict (it takes the saved settings)
    resume.finish(_restart_optimizer)
    rng_path = os.path.join(directory, RNG_DIR, f"rank_{rank()}.pt")
    if same_layout and os.path.exists(rng_path):
        _set_rng_states(torch.load(rng_path, weights_only=True))


def _model_keys(chunks: Sequence[torch.nn.Module]) -> list[str]:
    """megatron's convention: ``model``, or ``model0``, ``model1``... for virtual stages."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _sharded_state(
    chunks: Sequence[torch.nn.Module], optimizer: Any, *, loading: bool
) -> dict[str, Any]:
    # The inner chunks, not the DDP wrappers (whose keys carry a ``module.`` prefix).
    state: dict[str, Any] = {
        key: chunk.sharded_state_dict()  # type: ignore[operator]
        for key, chunk in zip(_model_keys(chunks), chunks, strict=True)
    }
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=loading, metadata=_OPTIMIZER_METADATA
        )
    return state


def _load_optimizer(optimizer: Any, state: Any) -> None:
    """``load_state_dict`` per chained optimizer. Around megatron-core 0.16.1's distributed
    optimizer with the torch AdamW fallback: its parameter-state loader copies every inner
    state key from the checkpoint, which keeps ``step`` elsewhere (KeyError 'step'), so
    ``step`` is set aside meanwhile; and it gives every parameter the same ``step`` tensor,
    which Adam would then bump once per parameter, so each gets its own copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    for part, part_state in zip(parts, _part_states(parts, state), strict=True):
        if not isinstance(part, DistributedOptimizer):
            # megatron saves the shared step only when it is non-zero (``if step:``)
            part_state["state"].setdefault("common_step", torch.zeros((), dtype=torch.float32))
            part.load_state_dict(part_state)
            continue
        param_state = part_state.pop("param_state")
        part_state.pop("param_state_sharding_type")
        part.load_state_dict(part_state)
        inner_state = part.optimizer.state
        steps = {
            param: entry.pop("step") for param, entry in inner_state.items() if "step" in entry
        }
        try:
            part.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for param, step in steps.items():  # megatron hands every parameter one shared
                inner_state[param]["step"] = step.clone()  # tensor; Adam bumps each in place


def _part_states(parts: Sequence[Any], state: dict[Any, Any]) -> list[dict[Any, Any]]:
    """Each chained optimizer's loaded state. Expert parallelism splits megatron's optimizer
    in two (dense and expert parameters): a checkpoint saved with another number of parts
    has the right tensors (they load by parameter name) but its other entries (the shared
    step, param groups, sharding type) under the other structure. They are taken from there,
    and the param groups from the live optimizer: their settings come from this engine's
    config, and the LR from the schedule restored after."""
    if len(parts) == 1:
        per_part, saved = [state], state.get(0, {})  # saved by several parts, or one
    else:
        per_part = [state[index] for index in range(len(parts))]
        saved = {key: value for key, value in state.items() if not isinstance(key, int)}
    if not saved:
        return per_part
    for part, part_state in zip(parts, per_part, strict=True):
        live = part.state_dict()
        for key, value in saved.items():
            if isinstance(value, dict) and isinstance(part_state.get(key), dict):
                for inner, inner_value in value.items():
                    part_state[key].setdefault(inner, inner_value)
            else:
                part_state.setdefault(key, value)
        if "param_groups" in live:
            part_state["param_groups"] = _live_groups(live, part_state)
        if "optimizer" in live and "optimizer" in part_state:
            groups = _live_groups(live["optimizer"], part_state["optimizer"])
            part_state["optimizer"] = {**part_state["optimizer"], "param_groups": groups}
    return per_part


def _live_groups(live: dict[str, Any], saved: dict[str, Any]) -> list[dict[str, Any]]:
    """The live optimizer's param groups with the saved step count (megatron's distributed
    optimizer keeps Adam's step in its groups)."""
    steps = [group["step"] for group in saved.get("param_groups", []) if "step" in group]
    groups = [dict(group) for group in live["param_groups"]]
    if steps:
        for group in groups:
            group["step"] = steps[0]
    return groups


def _restart_optimizer(optimizer: Any) -> None:
    """``optimizer`` as built, from the model's weights as they now are: no Adam state, fp32
    main parameters copied from the model (else the next step would write back the ones from
    before the load)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        part.optimizer.state.clear()
    optimizer.reload_model_params()


def _materialize_optimizer_state(optimizer: Any) -> None:
    """Give never-stepped parameters zero Adam state (what their first step starts from), so
    that a saved checkpoint and a loading template always hold every state tensor."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param].update(
                        step=torch.zeros((), dtype=torch.float32),
                        exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param),
                    )


def _rng_states() -> dict[str, Any]:
    """This process's streams (``strategies.checkpoint_files.rng_states``) and megatron's tracker
    streams."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker().get_states()
    return {**rng_states(), "tracker": {name: state.clone() for name, state in tracker.items()}}


def _set_rng_states(states: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    set_rng_states(states)
    get_cuda_rng_tracker().set_states(dict(states["tracker"]))
