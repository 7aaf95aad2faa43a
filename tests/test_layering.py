"""The dependency direction ``engine -> strategies -> heads`` holds in every module.

Checked on the source (``ast``), so imports under ``if TYPE_CHECKING:``, inside functions and
relative ones count too: a lower layer names what it needs of a higher one as a ``Protocol``
instead. Inside ``strategies/``, backends and device platforms do not import each other: the
Engine hands a backend the platform's torch device and a platform the backend's mesh-init hook.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Each source folder and the modules (with everything under them) it must not import.
FORBIDDEN = {
    "heads": ("strategies", "engine"),
    "strategies": ("engine",),
    "strategies/backends": ("strategies.devices",),
    "strategies/devices": ("strategies.backends",),
    # the Hugging Face generator the demo and verl share serves both, importing neither
    "engine/generation": ("engine.cli", "engine.integrations", "verl"),
}


def imported_modules(source: str, package: str = "") -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import in ``source``, a module of ``package``.

    ``from a.b import c`` yields ``a.b.c`` (``c`` may be a module or a name in ``a.b``);
    relative imports are resolved against ``package``.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return sorted(found)


def forbidden_imports(folder: str) -> list[str]:
    forbidden = FORBIDDEN[folder]
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, name in imported_modules(
            path.read_text(), ".".join(path.parent.relative_to(ROOT).parts)
        )
        if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden)
    ]


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_forbidden_imports(folder: str) -> None:
    assert (ROOT / folder / "__init__.py").exists()
    assert forbidden_imports(folder) == []


def test_the_scan_sees_type_checking_function_level_and_relative_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from engine.data.batching import MicroBatch\n"
        "def f():\n"
        "    import strategies.part_configs as c\n"
        "from strategies import backends\n"
        "from . import sibling\n"
        "from ..backends.base import Backend\n"
    )
    assert imported_modules(source, package="strategies.devices") == [
        (1, "typing.TYPE_CHECKING"),
        (3, "engine.data.batching.MicroBatch"),
        (5, "strategies.part_configs"),
        (6, "strategies.backends"),
        (7, "strategies.devices.sibling"),
        (8, "strategies.backends.base.Backend"),
    ]


#: Names several parts' modules share because they do the same job for each part: a part's
#: protocol, and the exceptions (defined in heads/, made public in engine/).
SHARED_BY_THE_PARTS = {"__init__.py", "base.py", "errors.py"}


def test_two_modules_share_a_name_only_where_they_do_one_job_for_two_backends() -> None:
    by_name: dict[str, list[Path]] = {}
    for layer in ("engine", "strategies", "heads"):
        for path in (ROOT / layer).rglob("*.py"):
            by_name.setdefault(path.name, []).append(path.relative_to(ROOT))
    backends = ROOT / "strategies" / "backends"
    shared = {
        name: sorted(str(path) for path in paths)
        for name, paths in by_name.items()
        if len(paths) > 1
        and name not in SHARED_BY_THE_PARTS
        # one per backend: strategies/backends/<backend>/.../name, each backend at most once
        and not (
            all(backends in (ROOT / path).parents for path in paths)
            and len({(ROOT / path).relative_to(backends).parts[0] for path in paths}) == len(paths)
        )
    }
    assert shared == {}
