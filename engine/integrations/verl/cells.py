"""The verl engine-registry cells this project registers, as data (no verl import).

verl looks an engine up by ``(model_type, backend, device[, vendor])``
(``verl.workers.engine.EngineRegistry.get_engine_cls``); registering a key it already holds is an
assertion error. Every cell below resolves to the one adapter class,
:class:`engine.integrations.verl.adapter.ComposableEngine`:

- our own backend names (``composable_megatron``, ``composable_fsdp2``), plain device keys, for
  every device verl knows and ``cpu``;
- verl's own backend names (``megatron``, ``fsdp2``, and ``fsdp``, the default strategy of
  verl's FSDP configs, served by the fsdp2 backend), whose config classes
  (``McoreEngineConfig``, ``FSDPEngineConfig``) only accept those strategies: on ``cuda`` /
  ``npu`` verl's engines hold the plain device keys, so ours are ``(device, "composable")``
  vendor keys, chosen with ``VERL_ENGINE_VENDOR=composable``; on ``cpu`` verl has no engine, so
  the plain ``cpu`` key is ours.
"""

from __future__ import annotations

import attrs

#: verl's model types -> this project's heads.
HEADS = {"language_model": "lm", "value_model": "value"}
#: Backend names verl's config may carry -> this project's backends.
BACKENDS = {
    "composable_megatron": "megatron",
    "composable_fsdp2": "fsdp2",
    "megatron": "megatron",
    "fsdp2": "fsdp2",
    "fsdp": "fsdp2",
}
#: The backend names verl's own engines already use (their cuda / npu keys are taken).
VERL_OWNED_BACKENDS = ("megatron", "fsdp2", "fsdp")
#: Devices verl registers engines for, plus the CPU.
DEVICES = ("cuda", "npu", "cpu")
#: The vendor key under which the adapter takes verl's own backend names on accelerators.
VENDOR = "composable"
#: The rollout name of :mod:`engine.integrations.verl.rollout`
#: (``actor_rollout_ref.rollout.name=composable_hf``).
ROLLOUT = "composable_hf"
#: The checkpoint engine of :mod:`engine.integrations.verl.checkpoint_engine` (gloo: weights to
#: rollout replicas apart from the trainer on a host without an accelerator).
CHECKPOINT_ENGINE = "composable_gloo"
#: The agent loop the launcher makes the default on a CPU host (one of :data:`AGENT_LOOPS`).
AGENT_LOOP = "composable_single_turn_agent"
#: verl's agent loops whose requests are named by their sample (reproducible sampling under
#: ``full_determinism``, :mod:`engine.integrations.verl.agent_loop`): the name each is
#: registered under (``rollout.agent.default_agent_loop``, a dataset's ``agent_name``) -> class.
AGENT_LOOPS = {
    AGENT_LOOP: "engine.integrations.verl.agent_loop.SingleTurnAgentLoop",
    "composable_tool_agent": "engine.integrations.verl.agent_loop.ToolAgentLoop",
}


@attrs.frozen
class Cell:
    """One ``EngineRegistry`` key: ``(model_type, backend, device, vendor or None)``."""

    model_type: str
    backend: str
    device: str
    vendor: str | None = None

    @property
    def key(self) -> str | tuple[str, str]:
        """The device key as verl stores it."""
        return self.device if self.vendor is None else (self.device, self.vendor)

    @property
    def environment(self) -> dict[str, str]:
        """The environment variables that make ``get_engine_cls`` pick this cell."""
        env = {"VERL_ENGINE_DEVICE": self.device}
        if self.vendor is not None:
            env["VERL_ENGINE_VENDOR"] = self.vendor
        return env


def registered_cells() -> list[Cell]:
    """Every cell the plug-in registers (the same adapter class for each)."""
    cells = []
    for model_type in HEADS:
        for backend in BACKENDS:
            for device in DEVICES:
                taken = backend in VERL_OWNED_BACKENDS and device != "cpu"
                cells.append(Cell(model_type, backend, device, VENDOR if taken else None))
    return cells
