"""FSDP2 backend state in a checkpoint directory: model and optimizer through
``torch.distributed.checkpoint`` (each rank writes its shards; a load reshards to any
data-parallel size), the LR schedule as JSON, this rank's RNG streams as a small tensor file.
An asynchronous save stages the same DCP files (``strategies.checkpoint_files.staged_dcp``) and
writes them in the background.

Collective: every rank calls ``save_state`` / ``load_state`` with the same directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from strategies.backends.fsdp2.optimizer import LRSchedule, materialize_optimizer_state
from strategies.checkpoint_files.publish import FileChecksums
from strategies.checkpoint_files.resume_settings import OptimizerResume, keeping_settings
from strategies.checkpoint_files.rng_states import rng_states, set_rng_states
from strategies.parallel.collectives import barrier, rank

if TYPE_CHECKING:
    from strategies.backends.base import StagedSave

STATE_DIR = "dcp"
SCHEDULER_FILE = "scheduler.json"
RNG_DIR = "rng"


def save_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    schedule: LRSchedule | None,
    directory: str,
) -> FileChecksums:
    """Write ``model``, ``optimizer`` and ``schedule`` (None for a forward-only engine) and this
    rank's RNG states under ``directory``; the size and checksum of this rank's DCP file."""
    from strategies.checkpoint_files.staged_dcp import save_dcp

    _make_directories(directory)
    state, _ = _state(model, optimizer)
    written = save_dcp(state, os.path.join(directory, STATE_DIR), STATE_DIR)
    _save_schedule_and_rng(schedule, directory)
    return written


def stage_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    schedule: LRSchedule | None,
    directory: str,
    buffers: dict[Any, torch.Tensor],
) -> StagedSave:
    """``save_state`` up to the model and optimizer files: planned (collective), their tensors
    copied into ``buffers`` (host memory kept between saves), the LR schedule and RNG states
    written; the DCP files are left to the returned save (any thread, no collectives)."""
    from strategies.checkpoint_files.staged_dcp import stage_dcp_save

    _make_directories(directory)
    state, _ = _state(model, optimizer)
    staged = stage_dcp_save(state, os.path.join(directory, STATE_DIR), STATE_DIR, buffers)
    _save_schedule_and_rng(schedule, directory)
    return staged


def _make_directories(directory: str) -> None:
    if rank() == 0:
        os.makedirs(os.path.join(directory, RNG_DIR), exist_ok=True)
    barrier()


def _save_schedule_and_rng(schedule: LRSchedule | None, directory: str) -> None:
    if rank() == 0 and schedule is not None:
        with open(os.path.join(directory, SCHEDULER_FILE), "w") as handle:
            json.dump(schedule.state_dict(), handle)
    torch.save(rng_states(), os.path.join(directory, RNG_DIR, f"rank_{rank()}.pt"))


def load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    schedule: LRSchedule | None,
    directory: str,
    *,
    same_layout: bool,
) -> None:
    """Restore what ``save_state`` wrote, resharded to this layout; per-rank RNG streams only at
    the same layout (at another one there is no rank to take them from). The optimizer and LR
    schedule keep this engine's settings (``strategies.checkpoint_files.resume_settings``). A
    forward-only engine's checkpoint (weights only) leaves this engine's optimizer and LR schedule
    as a new engine's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    resume = OptimizerResume.at(os.path.join(directory, SCHEDULER_FILE), optimizer, schedule)
    optimizer = resume.loaded_optimizer
    state, aliases = _state(model, optimizer)
    dcp.load(state, checkpoint_id=os.path.join(directory, STATE_DIR))
    for alias, name in aliases.items():  # a tied weight: loaded once, set under both names
        state["model"][alias] = state["model"][name]
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        with keeping_settings([optimizer]):
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
    resume.finish(_clear_state)
    rng_path = os.path.join(directory, RNG_DIR, f"rank_{rank()}.pt")
    if same_layout and os.path.exists(rng_path):
        set_rng_states(torch.load(rng_path, weights_only=True))


def _state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """``{"model": ..., "optimizer": ...}`` state dicts under fully qualified names, sharded, with
    each tied weight (a parameter under several names: an embedding shared with the output
    layer) under its first name only, so it is written and read once; and those other names,
    each mapped to the name kept."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        materialize_optimizer_state(optimizer)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    aliases = tied_names(model, state["model"].keys())
    for alias in aliases:
        del state["model"][alias]
    return state, aliases


def tied_names(model: torch.nn.Module, keys: Iterable[str]) -> dict[str, str]:
    """Among ``keys`` (the model state dict's), each name of a parameter that an earlier name
    already holds (tied weights), mapped to that first name. Decided by the parameters
    themselves, so every rank drops the same names whatever its shard holds."""
    present = set(keys)
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if name not in present:
            continue
        kept = first.setdefault(id(parameter), name)
        if kept != name:
            aliases[name] = kept
    return aliases


def _clear_state(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` as built: no Adam state."""
    optimizer.state.clear()
