"""verl plug-in: verl's trainers and workers run on this project's ``Engine``.

``import verl`` loads the entry point ``composable_engine`` of the group ``verl.plugins``
(:mod:`engine.integrations.verl.plugin`), which registers

- :class:`~engine.integrations.verl.platform.CpuPlatform` as verl's ``cpu`` platform, and
- :class:`~engine.integrations.verl.adapter.ComposableEngine`, one ``BaseEngine`` subclass, for
  every cell :func:`registered_cells` lists, and
- the ``composable_hf`` rollout (:mod:`engine.integrations.verl.rollout`), a Hugging Face
  generator for verl's RL trainer where vLLM and SGLang cannot run, and
- the ``composable_gloo`` checkpoint engine (:mod:`engine.integrations.verl.checkpoint_engine`),
  weights to rollout replicas apart from the trainer over gloo, and
- verl's agent loops with requests named by their sample
  (:mod:`engine.integrations.verl.agent_loop`, :data:`~engine.integrations.verl.cells.AGENT_LOOPS`).

verl is imported only inside this package, and only when verl loads the plug-in (or
:func:`register` is called).
"""

from __future__ import annotations

import importlib
import sys

from engine.integrations.verl.cells import (
    AGENT_LOOPS,
    CHECKPOINT_ENGINE,
    ROLLOUT,
    Cell,
    registered_cells,
)

__all__ = ["Cell", "register", "registered_cells"]


def register() -> None:
    """Register the CPU platform, the adapter for every cell and the rollout (idempotent)."""
    # The platform first: importing verl's engines asks verl for its platform, which it then
    # resolves once for the whole process.
    importlib.import_module("engine.integrations.verl.platform")
    adapter = sys.modules.get("engine.integrations.verl.adapter")
    if adapter is None or hasattr(adapter, "register_cells"):
        from engine.integrations.verl.adapter import register_cells

        register_cells()
    # else verl loads the plug-in while the adapter module, imported before verl, imports
    # it: the adapter registers its cells itself once its class exists
    _register_rollout()
    _register_agent_loops()
    _register_checkpoint_engine()


def _register_rollout() -> None:
    """The ``composable_hf`` rollout in verl's two rollout registries, by name: its module
    (which imports verl's rollout classes) is imported when verl first asks for it, not here,
    where verl itself may still be importing."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    module = "engine.integrations.verl.rollout"
    RolloutReplicaRegistry.register(ROLLOUT, lambda: importlib.import_module(module).HFReplica)
    base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = f"{module}.HFServerAdapter"


def _register_agent_loops() -> None:
    """:data:`AGENT_LOOPS` in verl's agent-loop registry, by class path (hydra imports the
    class when a loop is built)."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    for name, target in AGENT_LOOPS.items():
        _agent_loop_registry.setdefault(name, {"_target_": target})


def _register_checkpoint_engine() -> None:
    """:data:`CHECKPOINT_ENGINE` in verl's ``CheckpointEngineRegistry``."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from engine.integrations.verl.checkpoint_engine import GlooCheckpointEngine

    CheckpointEngineRegistry.register(CHECKPOINT_ENGINE)(GlooCheckpointEngine)
