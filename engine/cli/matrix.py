"""``python -m engine matrix``: every head x backend x device cell the registries know, whether
it can run on this machine and, if not, why; plus the versions that matter."""

from __future__ import annotations

import importlib.metadata
import math
from typing import Any

from engine.registry import BACKENDS, DEVICES, HEADS
from strategies.backends.base import Backend, abilities

PACKAGES = ("torch", "megatron-core", "tensordict", "transformers", "torch-npu", "mindspeed")


def _part_problem(registry: Any, name: str) -> str | None:
    """Why the part ``name`` cannot be used here (None when it can)."""
    try:
        part = registry.create(name)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    if registry is DEVICES:
        state = part.availability()
        return None if state.ok else state.reason
    if registry is BACKENDS and isinstance(part, Backend):
        from engine.config import EngineConfig

        try:
            part.validate(EngineConfig(), 1)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
    return None


def cells() -> list[dict[str, Any]]:
    """One entry per cell: its parts, whether it runs here, and the reasons it does not."""
    problems = {
        (kind, name): _part_problem(registry, name)
        for kind, registry in (("head", HEADS), ("backend", BACKENDS), ("device", DEVICES))
        for name in registry.names()
    }
    rows = []
    for head in HEADS.names():
        for backend in BACKENDS.names():
            for device in DEVICES.names():
                reasons = [
                    _labelled(kind, name, problem)
                    for kind, name in (("head", head), ("backend", backend), ("device", device))
                    if (problem := problems[(kind, name)])
                ]
                rows.append(
                    {
                        "head": head,
                        "backend": backend,
                        "device": device,
                        "runs_here": not reasons,
                        "reasons": reasons,
                    }
                )
    return rows


def grouped_by_reasons(rows: list[dict[str, Any]]) -> list[tuple[list[str], list[dict[str, Any]]]]:
    """The cells grouped by why they cannot run here (the empty reason list: they run), in the
    order the groups first appear: a device's missing runtime is one reason for every cell."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row["reasons"]), []).append(row)
    return [(list(reasons), members) for reasons, members in groups.items()]


def describe_cells(rows: list[dict[str, Any]]) -> str:
    """``{lm, value} x {fsdp2, megatron} x cpu`` where the cells are every combination of their
    parts; else each cell, comma-separated."""
    axes = [
        list(dict.fromkeys(row[part] for row in rows)) for part in ("head", "backend", "device")
    ]
    if math.prod(len(names) for names in axes) == len(rows):
        return " x ".join(
            names[0] if len(names) == 1 else f"{{{', '.join(names)}}}" for names in axes
        )
    return ", ".join(f"{row['head']} x {row['backend']} x {row['device']}" for row in rows)


def text_report(
    rows: list[dict[str, Any]],
    backends: dict[str, list[str] | None],
    installed: dict[str, str | None],
) -> list[str]:
    """The lines ``python -m engine matrix`` prints: each reason once, under the cells it
    stops; then the backends' abilities and the versions."""
    lines = []
    for reasons, members in grouped_by_reasons(rows):
        status = "unavailable" if reasons else "runs here"
        lines.append(f"{status}: {describe_cells(members)}")
        lines += [f"    {reason}" for reason in reasons]
    for name, offered in backends.items():
        listed = ", ".join(offered) if offered is not None else "cannot be built here"
        lines.append(f"backend {name} abilities: {listed or 'none'}")
    lines.append(
        "versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in installed.items())
    )
    return lines


def backend_abilities() -> dict[str, list[str] | None]:
    """Each registered backend's optional abilities (None: it cannot be built here)."""
    found: dict[str, list[str] | None] = {}
    for name in BACKENDS.names():
        try:
            found[name] = abilities(BACKENDS.create(name))
        except Exception:
            found[name] = None
    return found


def _labelled(kind: str, name: str, problem: str) -> str:
    return problem if problem.startswith(f"{name}:") else f"{kind} {name}: {problem}"


def versions() -> dict[str, str | None]:
    """Installed versions of the packages the engine uses (None: not installed)."""
    found: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found
