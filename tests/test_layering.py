"""The dependency direction ``engine -> strategies -> heads`` holds in every module.

Checked on the source (``ast``), so imports under ``if TYPE_CHECKING:`` and inside functions
count too: a lower layer names what it needs of a higher one as a ``Protocol`` instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Each package and the packages it must not import.
FORBIDDEN = {"heads": {"strategies", "engine"}, "strategies": {"engine"}}


def imported_packages(source: str) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every absolute import in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return sorted(found)


def upward_imports(package: str) -> list[str]:
    forbidden = FORBIDDEN[package]
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in imported_packages(path.read_text())
        if name in forbidden
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package: str) -> None:
    assert (ROOT / package / "__init__.py").exists()
    assert upward_imports(package) == []


def test_the_scan_sees_type_checking_and_function_level_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from engine.batching import MicroBatch\n"
        "def f():\n"
        "    import strategies.config as c\n"
        "from . import sibling\n"
    )
    assert imported_packages(source) == [(1, "typing"), (3, "engine"), (5, "strategies")]
