"""The manifest: what a checkpoint directory records (format version, the engine's description,
every file's size and checksum), written last; read, verified and checked against the loading
engine before a load."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from heads.errors import CheckpointError
from strategies.checkpoint_files.publish import (
    CHECKSUMS,
    WRITE_CHECKSUM,
    FileChecksums,
    file_checksum,
    fsync_path,
)
from strategies.part_configs import ModelConfig

#: 2: files are checksummed with xxh3-128 (version 1 manifests, with sha256, still load).
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
#: The config sections whose settings a resume takes from the loading engine.
_RESUMED_SETTINGS = ("optimizer", "scheduler", "total_steps")
_MODEL_SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
    "ffn_hidden_size", "head_dim", "tie_embeddings", "add_qkv_bias", "qk_layernorm",
)  # fmt: skip


def describe(engine: Mapping[str, Any], global_step: int) -> dict[str, Any]:
    """What the manifest records of ``engine`` at ``global_step``, besides the files."""
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


def write_manifest(directory: str, description: dict[str, Any], written: FileChecksums) -> None:
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
        and all(isinstance(entry, dict) and is_count(entry.get("size")) for entry in files.values())
        and is_count(step)
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


def check_compatible(directory: str, manifest: dict[str, Any], ours: dict[str, Any]) -> None:
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


def taken_by_another_engine(target: str, engine: Mapping[str, Any]) -> str | None:
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


def changed_settings(saved: Any, ours: Mapping[str, Any]) -> list[str]:
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


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
