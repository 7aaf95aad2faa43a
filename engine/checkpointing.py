"""Engine checkpoints on disk: one root, one ``global_step_{N}/`` directory per save, each
published whole.

A save writes into a temporary sibling (``.tmp-global_step_{N}-<random>``); after every rank
has written its part, rank 0 fsyncs the files, writes ``manifest.json`` last (format version,
engine config, head, model shape, step, parallel layout, every file's size and checksum) and
renames the directory into place. A file the backend checksummed while writing it (its
``save_state`` says which) is not read back; its size on disk must match what was written.
A directory without a readable manifest is not a checkpoint, so a save killed at any point
leaves the previous checkpoint as the latest. An asynchronous save (:func:`start_async_save`)
publishes the same way from a background thread once every rank's files are on disk.
Loading verifies the manifest (version, head, model shape, sizes and checksums) before any
state changes. What is in the files is the backend's business (its ``Checkpointing``
ability); this module receives that ability and a description of the engine (head, backend,
model, layout, config), never the Engine itself.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import psutil
from torch.distributed.checkpoint.api import CheckpointException

from heads.errors import CheckpointError, ConfigError
from strategies.backends.base import AsyncCheckpointing, Checkpointing, StagedSave
from strategies.checkpoint_files.publish import (
    CHECKSUMS,
    WRITE_CHECKSUM,
    FileChecksums,
    file_checksum,
    fsync_path,
    publish_directory,
)
from strategies.config import ModelConfig
from strategies.parallel.collectives import collective_timeout, from_rank_zero, merged_dicts, rank

#: 2: files are checksummed with xxh3-128 (version 1 manifests, with sha256, still load).
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
STEP_PREFIX = "global_step_"
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
#: A save's temporary directory (and the aside name of a replaced checkpoint of the same step).
_STAGING_DIR = re.compile(
    rf"^\.tmp-{STEP_PREFIX}(?P<step>\d+)-(?P<space>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}(-replaced)?$"
)
#: Test hook: the saving process SIGKILLs itself when it reaches the named stage
#: (``after_state``, ``before_manifest``, ``before_rename``).
KILL_AT_ENV = "COMPOSABLE_ENGINE_CHECKPOINT_KILL_AT"
#: What a failed write raises: torch's ``CheckpointException`` (megatron's too) is a
#: BaseException, which ``except Exception`` lets through.
_WRITE_FAILURES = (Exception, CheckpointException)
#: The config sections whose settings a resume takes from the loading engine.
_RESUMED_SETTINGS = ("optimizer", "scheduler", "total_steps")
_MODEL_SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
    "ffn_hidden_size", "head_dim", "tie_embeddings", "add_qkv_bias", "qk_layernorm",
)  # fmt: skip


def save_checkpoint(
    state: Checkpointing,
    engine: Mapping[str, Any],
    root: str,
    global_step: int,
    max_ckpt_to_keep: int | None,
) -> str:
    """Write ``state`` to ``root/global_step_{global_step}`` (collective); ``engine`` describes
    the engine (``head``, ``backend``, ``model``, ``parallel``, ``config``). Returns the path."""
    target, staging = _begin_save(root, global_step, max_ckpt_to_keep, engine)
    try:
        written, failure = state.save_state(staging) or {}, None
    except _WRITE_FAILURES as raised:
        written, failure = {}, raised
    written, _ = _written_everywhere(target, staging, written, failure)
    _stage("after_state")
    error = None
    if rank() == 0:
        error = _publish(staging, target, _describe(engine, global_step), written, max_ckpt_to_keep)
    error = from_rank_zero(error)
    if error is not None:
        raise CheckpointError(error)
    return target


def start_async_save(
    state: AsyncCheckpointing,
    engine: Mapping[str, Any],
    root: str,
    global_step: int,
    max_ckpt_to_keep: int | None,
) -> AsyncSave:
    """:func:`save_checkpoint`, returning once the state is staged (collective: planning, and
    the state copied out of the model and optimizer); a background thread writes the files.
    Every rank's thread leaves a marker in the temporary directory when its files are on disk;
    rank 0's then finishes the save, writes the manifest and publishes the directory, as a
    synchronous save does (no collectives in the background). Before its next save or load
    every rank calls :func:`finish_async_save`; a process exit waits for it too."""
    target, staging = _begin_save(root, global_step, max_ckpt_to_keep, engine)
    staged: StagedSave | None = None
    try:
        staged, failure = state.stage_state(staging), None
    except _WRITE_FAILURES as raised:
        failure = raised
    _, savers = _written_everywhere(target, staging, {}, failure)  # none waits for a failed one
    assert staged is not None
    description = _describe(engine, global_step)
    return AsyncSave(staged, staging, target, description, max_ckpt_to_keep, savers)


def _written_everywhere(
    target: str, staging: str, written: FileChecksums, failure: BaseException | None
) -> tuple[FileChecksums, list[tuple[str, int]]]:
    """Every rank's ``written`` merged, and each rank's saving process (:func:`_process_space`,
    pid), by rank (collective). If any rank's part of the save failed (``failure``),
    CheckpointError on every rank, naming each failed rank, and the temporary directory is
    removed."""
    report = None if failure is None else f"rank {rank()} could not write its files: {failure!r}"
    saver = (_process_space(), os.getpid())
    parts = merged_dicts({str(rank()): (report, written, saver)})
    by_rank = [parts[key] for key in sorted(parts, key=int)]
    failed = [report for report, _, _ in by_rank if report is not None]
    if failed:
        if rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"cannot write the checkpoint {target}: {'; '.join(failed)}") from (
            failure
        )
    merged = {name: entry for _, files, _ in by_rank for name, entry in files.items()}
    return merged, [saver for _, _, saver in by_rank]


def finish_async_save(save: AsyncSave) -> str:
    """Wait for ``save`` (collective); CheckpointError on every rank if any rank's part or the
    publishing failed. Returns the published directory."""
    error = save.wait()
    try:
        errors = merged_dicts({str(rank()): error} if error is not None else {})
    except RuntimeError as failure:  # a rank is gone (the backends' errors derive from it)
        lost = f"cannot write the checkpoint {save.target}: a rank is gone ({failure})"
        raise CheckpointError(error or lost) from failure
    if errors:
        raise CheckpointError(errors.get("0") or next(iter(errors.values())))
    return save.target


class AsyncSave:
    """A save in flight (see :func:`start_async_save`): this rank's background thread."""

    def __init__(
        self,
        staged: StagedSave,
        staging: str,
        target: str,
        description: dict[str, Any],
        max_ckpt_to_keep: int | None,
        savers: Sequence[tuple[str, int]],
    ) -> None:
        self.target = target
        self._error: str | None = None
        peers = (rank(), savers, collective_timeout())
        self._thread = threading.Thread(
            target=self._run,
            args=(staged, staging, description, max_ckpt_to_keep, *peers),
            name=f"checkpoint-save-{os.path.basename(target)}",
        )
        _IN_FLIGHT.add(self)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str | None:
        """Block until this rank's part (on rank 0: the whole save) is done; its error, if any
        (rank 0's names any rank that failed)."""
        self._thread.join()
        _IN_FLIGHT.discard(self)
        return self._error

    def _run(
        self,
        staged: StagedSave,
        staging: str,
        description: dict[str, Any],
        max_ckpt_to_keep: int | None,
        this_rank: int,
        savers: Sequence[tuple[str, int]],
        peer_timeout: float,
    ) -> None:
        try:
            outcome: tuple[FileChecksums, Any] | str = staged.write()
            _stage("after_state")
        except _WRITE_FAILURES as failure:
            outcome = f"rank {this_rank} could not write its files: {failure!r}"
            self._error = f"cannot write the checkpoint {self.target}: {outcome}"
        if this_rank != 0:
            try:
                _write_marker(staging, this_rank, outcome)
            except OSError as failure:
                self._error = f"cannot write the checkpoint {self.target}: {failure}"
            return
        try:
            deadline = time.monotonic() + peer_timeout
            parts = [outcome]
            for peer in range(1, len(savers)):
                parts.append(_read_marker(staging, peer, savers[peer], deadline, peer_timeout))
            failed = [part for part in parts if isinstance(part, str)]
            if failed:
                raise CheckpointError("; ".join(failed))
            written = [part for part in parts if not isinstance(part, str)]
            staged.finish([result for _, result in written])
            checksums = {name: entry for files, _ in written for name, entry in files.items()}
            self._error = _publish(staging, self.target, description, checksums, max_ckpt_to_keep)
        except _WRITE_FAILURES as failure:
            self._error = f"cannot write the checkpoint {self.target}: {failure}"
        if self._error is not None:
            shutil.rmtree(staging, ignore_errors=True)


#: Saves whose thread nobody has waited for yet (a process exit waits for them).
_IN_FLIGHT: set[AsyncSave] = set()
_MARKER = ".written-rank-{}"


@atexit.register
def _wait_at_exit() -> None:
    """A process exits only once its in-flight saves are done. If one failed, the process
    reports it and ends with status 1: an exception raised in an exit handler is printed,
    "ignored", and leaves the exit status 0, so a job whose last checkpoint was lost would
    look successful. Exit handlers registered before this module was imported (before the
    first checkpoint save) then do not run; logging is flushed."""
    errors = [error for save in list(_IN_FLIGHT) if (error := save.wait()) is not None]
    if not errors:
        return
    print(f"CheckpointError: {'; '.join(errors)}", file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


def _write_marker(staging: str, this_rank: int, outcome: Any) -> None:
    """This rank's part of an asynchronous save (or why it failed), for rank 0's thread: the
    marker's existence says that the rank's files are on disk."""
    path = os.path.join(staging, _MARKER.format(this_rank))
    with open(f"{path}.partial", "wb") as handle:
        pickle.dump(outcome, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(f"{path}.partial", path)


def _read_marker(
    staging: str, peer: int, saver: tuple[str, int], deadline: float, timeout: float
) -> Any:
    """Wait for the marker of ``peer`` (whose process is ``saver``: space, pid) until
    ``deadline`` (``time.monotonic()``: rank 0 waits for all its peers as long as a collective
    would, ``timeout``), or until that process is seen gone; its content (the marker is
    removed: not a checkpoint file)."""
    path = os.path.join(staging, _MARKER.format(peer))
    while not os.path.exists(path):
        if not _alive(*saver) and not os.path.exists(path):
            raise CheckpointError(
                f"rank {peer} (process {saver[1]} on this host) ended before writing its files"
            )
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank {peer} did not finish writing its files within {timeout:.0f} s "
                "(the process group's timeout): it failed or died"
            )
        time.sleep(0.01)
    with open(path, "rb") as handle:
        outcome = pickle.load(handle)
    os.remove(path)
    return outcome


def _process_space() -> str:
    """Where a process id means the same process as here: this host and its pid namespace
    (containers on one host may share a host name, not their process ids); usable in a file
    name."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = "unknown"
    return f"{socket.gethostname()}@{namespace}"


def _alive(space: str, pid: int) -> bool:
    """Whether the process ``pid`` of ``space`` may still run (another space's: not known)."""
    if space != _process_space() or space.endswith("@unknown"):
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _taken_by_another_engine(target: str, engine: Mapping[str, Any]) -> str | None:
    """Why a save must not replace the checkpoint already at ``target``: one of another
    backend or head (a same engine's re-save of a step replaces it, as it always has)."""
    if not os.path.isfile(os.path.join(target, MANIFEST)):
        return None
    try:
        saved = read_manifest(target)
    except CheckpointError:
        return None
    theirs = (saved.get("backend"), saved.get("head"))
    if theirs == (engine["backend"], engine["head"]):
        return None
    return (
        f"{target} holds a checkpoint of a {theirs[1]!r} head engine on the {theirs[0]!r} "
        f"backend; this {engine['head']!r} head engine on the {engine['backend']!r} backend "
        "would replace it. Save under another directory (or remove that checkpoint first)"
    )


def _begin_save(
    root: str, global_step: int, max_ckpt_to_keep: int | None, engine: Mapping[str, Any]
) -> tuple[str, str]:
    """The target directory and the temporary one a save writes (made by rank 0; collective)."""
    if not _is_count(global_step) or global_step < 0:
        raise ConfigError(f"global_step must be an int >= 0; got {global_step!r}")
    if max_ckpt_to_keep is not None and (not _is_count(max_ckpt_to_keep) or max_ckpt_to_keep < 1):
        raise ConfigError(f"max_ckpt_to_keep must be an int >= 1 or None; got {max_ckpt_to_keep!r}")
    root = os.path.abspath(os.fspath(root))
    target = os.path.join(root, f"{STEP_PREFIX}{global_step}")
    made: tuple[str, str | None] = ("", None)
    if rank() == 0 and (taken := _taken_by_another_engine(target, engine)) is not None:
        made = ("", taken)
    elif rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            remove_abandoned_saves(root)
            owner = f"{_process_space()}-{os.getpid()}"
            staging = os.path.join(
                root, f".tmp-{STEP_PREFIX}{global_step}-{owner}-{secrets.token_hex(4)}"
            )
            os.makedirs(staging)
            made = (staging, None)
        except OSError as error:
            made = ("", f"cannot write a checkpoint under {root}: {error}")
    staging, failure = from_rank_zero(made)
    if failure is not None:
        raise CheckpointError(failure)
    return target, staging


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _publish(
    staging: str,
    target: str,
    description: dict[str, Any],
    written: FileChecksums,
    max_ckpt_to_keep: int | None,
) -> str | None:
    """On rank 0: manifest, rename into place, retention. Why it failed, or None."""
    try:
        _stage("before_manifest")
        _write_manifest(staging, description, written)
        _stage("before_rename")
        publish_directory(staging, target)
        if max_ckpt_to_keep is not None:
            root = os.path.dirname(target)
            for _, old in complete_checkpoints(root)[:-max_ckpt_to_keep]:
                shutil.rmtree(old, ignore_errors=True)
    except (OSError, CheckpointError) as failure:
        return f"cannot write the checkpoint {target}: {failure}"
    return None


def load_checkpoint(
    state: Checkpointing, engine: Mapping[str, Any], path: str
) -> tuple[str, int, dict[str, Any]]:
    """Verify, then restore into ``state`` the checkpoint at ``path`` (a root: its newest
    complete checkpoint; or one ``global_step_*`` directory) saved by an engine like
    ``engine`` (see :func:`save_checkpoint`). Collective; returns the directory loaded, its
    global step and the non-finite guard's counters it recorded (empty when it has none)."""
    found: tuple[str, dict[str, Any]] | str | None = None
    if rank() == 0:
        try:
            directory = resolve_checkpoint(os.fspath(path))
            manifest = read_manifest(directory)
            _check_compatible(directory, manifest, _describe(engine, 0))
            verify_files(directory, manifest)
            found = (directory, manifest)
        except (CheckpointError, OSError) as error:  # every rank raises, none waits for rank 0
            found = str(error)
    found = from_rank_zero(found)
    if isinstance(found, str) or found is None:
        raise CheckpointError(found)
    directory, manifest = found
    state.load_state(directory, same_layout=manifest.get("parallel") == engine["parallel"])
    changed = _changed_settings(manifest.get("config"), engine["config"])
    if changed and rank() == 0:
        warnings.warn(
            f"resuming {directory} with settings changed since it was saved; this engine's "
            f"apply from the resumed step on: {', '.join(changed)}",
            stacklevel=3,
        )
    guard = manifest.get("non_finite")
    return directory, int(manifest["global_step"]), dict(guard) if isinstance(guard, dict) else {}


def _changed_settings(saved: Any, ours: Mapping[str, Any]) -> list[str]:
    """``name saved -> ours`` for each optimizer or LR-schedule setting (the ones a resume takes
    from this engine's config, never from the checkpoint:
    ``strategies.checkpoint_files.resume_settings``) that differs, where both engines train; a
    setting the manifest does not record is not reported."""
    if not isinstance(saved, Mapping) or saved.get("forward_only") or ours["forward_only"]:
        return []
    flat_saved, flat_ours = _flat_settings(saved), _flat_settings(ours)
    return [
        f"{name} {flat_saved[name]} -> {value}"
        for name, value in flat_ours.items()
        if name in flat_saved and flat_saved[name] != value
    ]


def _flat_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The resumed settings of a config dict, by dotted name (``optimizer.lr``)."""
    flat = {}
    for section in _RESUMED_SETTINGS:
        value = config.get(section)
        if isinstance(value, Mapping):
            flat.update({f"{section}.{name}": inner for name, inner in value.items()})
        elif section in config:
            flat[section] = value
    return flat


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``global_step_*`` directory with a readable manifest, oldest
    first (temporary and manifest-less directories are not checkpoints)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match is None or not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        try:
            read_manifest(path)
        except CheckpointError:
            continue
        found.append((int(match.group(1)), path))
    return sorted(found)


def remove_abandoned_saves(root: str) -> list[str]:
    """Delete the temporary directories of saves whose process is gone (killed mid-save): each
    one's name carries the saving host, its pid namespace and the process id; a live process's
    save, or another host's or container's, is never touched. Returns the paths removed."""
    space, removed = _process_space(), []
    for name in os.listdir(root):
        match = _STAGING_DIR.match(name)
        if match is None or match["space"] != space or psutil.pid_exists(int(match["pid"])):
            continue
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory itself, or a root's newest complete checkpoint."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MANIFEST}: the save did not finish); "
            "load its root to get the newest complete one"
        )
    complete = complete_checkpoints(path)
    if not complete:
        raise CheckpointError(
            f"no complete checkpoint under {path} (looked for {STEP_PREFIX}<N>/ directories "
            f"holding a valid {MANIFEST})"
        )
    newest, chosen = complete[-1]
    for name in sorted(os.listdir(path)):
        match = _STEP_DIR.match(name)
        staged = _STAGING_DIR.match(name)
        if match is not None and int(match.group(1)) > newest:
            warnings.warn(
                f"skipping {os.path.join(path, name)}: it is not a complete checkpoint (no valid "
                f"{MANIFEST}); loading the newest complete one, {chosen}",
                stacklevel=2,
            )
        elif staged is not None and not name.endswith("-replaced") and int(staged["step"]) > newest:
            warnings.warn(
                f"skipping the save of step {staged['step']} in {os.path.join(path, name)}: "
                "it did not finish (interrupted, or still being written); loading the "
                f"newest complete checkpoint, {chosen}",
                stacklevel=2,
            )
    return chosen


def read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as handle:
            manifest = json.load(handle)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read the checkpoint manifest {path}: {error}") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format_version"), int):
        raise CheckpointError(f"{path} is not a checkpoint manifest (no format_version)")
    if manifest["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {directory} has format_version {manifest['format_version']}, newer than "
            f"this composable-engine reads ({FORMAT_VERSION}); upgrade composable-engine"
        )
    files, step = manifest.get("files"), manifest.get("global_step")
    if not (
        isinstance(files, dict)
        and all(
            isinstance(entry, dict) and _is_count(entry.get("size")) for entry in files.values()
        )
        and _is_count(step)
    ):
        raise CheckpointError(
            f"{path} is malformed: it needs 'global_step' (an int) and 'files' (each file's "
            "size and checksum)"
        )
    return manifest


def verify_files(directory: str, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is there with its size and checksum (xxh3-128, or sha256
    in a version 1 manifest)."""
    for name, entry in manifest["files"].items():
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointError(f"checkpoint {directory} is missing {name}") from None
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint file {path} has {size} bytes, the manifest says {entry['size']} "
                "(truncated or overwritten)"
            )
        algorithm = next((name for name in CHECKSUMS if name in entry), None)
        if algorithm is None:
            raise CheckpointError(f"the manifest of {directory} gives {name} no checksum")
        if file_checksum(path, algorithm) != entry[algorithm]:
            raise CheckpointError(f"checkpoint file {path} is corrupted ({algorithm} mismatch)")


def _describe(engine: Mapping[str, Any], global_step: int) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "global_step": global_step,
        "head": engine["head"],
        "backend": engine["backend"],
        "model_shape": model_shape(engine["model"]),
        "parallel": engine["parallel"],
        "config": engine["config"],
        "non_finite": dict(engine.get("non_finite", {})),
    }


def model_shape(model: ModelConfig) -> dict[str, Any]:
    """What must match for the weights to fit (layout-independent)."""
    shape = {name: getattr(model, name) for name in _MODEL_SHAPE_FIELDS}
    shape.update(
        num_query_groups=model.num_query_groups or model.num_attention_heads,
        ffn_hidden_size=model.resolved_ffn_hidden_size,
    )
    return shape


def _check_compatible(directory: str, manifest: dict[str, Any], ours: dict[str, Any]) -> None:
    if manifest.get("backend", ours["backend"]) != ours["backend"]:
        raise CheckpointError(
            f"checkpoint {directory} was saved by the {manifest.get('backend')!r} backend; this "
            f"engine runs the {ours['backend']!r} backend, which cannot read it"
        )
    if manifest.get("head") != ours["head"]:
        raise CheckpointError(
            f"checkpoint {directory} was saved by a {manifest.get('head')!r} head engine; this "
            f"engine has a {ours['head']!r} head"
        )
    saved_lora = (manifest.get("config") or {}).get("lora")
    if saved_lora != ours["config"]["lora"]:
        raise CheckpointError(
            f"checkpoint {directory} was saved with lora={saved_lora}; this engine has "
            f"lora={ours['config']['lora']} (a checkpoint holds exactly its engine's adapters; to "
            "start adapters from a trained model, give its save_hf() directory as the model)"
        )
    saved = manifest.get("model_shape", {})
    if saved != ours["model_shape"]:
        differ = sorted(k for k in ours["model_shape"] if saved.get(k) != ours["model_shape"][k])
        theirs = ", ".join(f"{k}={saved.get(k)}" for k in differ)
        mine = ", ".join(f"{k}={ours['model_shape'][k]}" for k in differ)
        raise CheckpointError(
            f"checkpoint {directory} holds a model of another shape ({theirs}); this engine's "
            f"model has {mine}"
        )


def _write_manifest(directory: str, description: dict[str, Any], written: FileChecksums) -> None:
    """fsync every file and record its size and checksum (from ``written`` where the writer
    checksummed it, else read back), then write the manifest."""
    files = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, directory)
            fsync_path(path)
            size = os.path.getsize(path)
            entry = written.get(relative)
            if entry is None:
                entry = {"size": size, WRITE_CHECKSUM: file_checksum(path)}
            elif entry["size"] != size:
                raise CheckpointError(
                    f"{path} has {size} bytes on disk, but {entry['size']} were written"
                )
            files[relative] = entry
        fsync_path(folder)
    manifest = {**description, "files": dict(sorted(files.items()))}
    path = os.path.join(directory, MANIFEST)
    with open(path, "w") as handle:
        json.dump(manifest, handle, indent=1, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_path(directory)


def _stage(name: str) -> None:
    if os.environ.get(KILL_AT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
