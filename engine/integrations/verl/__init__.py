"""verl plug-in: verl's trainers and workers run on this project's ``Engine``.

``import verl`` loads the entry point ``composable_engine`` of the group ``verl.plugins``
(:mod:`engine.integrations.verl.plugin`), which registers

- :class:`~engine.integrations.verl.platform.CpuPlatform` as verl's ``cpu`` platform, and
- :class:`~engine.integrations.verl.adapter.ComposableEngine`, one ``BaseEngine`` subclass, for
  every cell :func:`registered_cells` lists.

verl is imported only inside this package, and only when verl loads the plug-in (or
:func:`register` is called).
"""

from __future__ import annotations

import importlib

from engine.integrations.verl.cells import Cell, registered_cells

__all__ = ["Cell", "register", "registered_cells"]


def register() -> None:
    """Register the CPU platform and the adapter for every cell (idempotent)."""
    # The platform first: importing verl's engines asks verl for its platform, which it then
    # resolves once for the whole process.
    importlib.import_module("engine.integrations.verl.platform")
    from verl.workers.engine.base import EngineRegistry

    from engine.integrations.verl.adapter import ComposableEngine

    for cell in registered_cells():
        known = EngineRegistry._engines.get(cell.model_type, {}).get(cell.backend, {})
        if known.get(cell.key) is ComposableEngine:
            continue
        EngineRegistry.register(
            model_type=cell.model_type,
            backend=cell.backend,
            device=cell.device,
            vendor=cell.vendor,
        )(ComposableEngine)
