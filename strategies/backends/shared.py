"""What the built-in backends hold alike, with the methods that only pass it through.

``BackendState`` keeps a backend's optimizer (refused while there is none: a forward-only or
not yet initialised engine), the parts it has offloaded to host memory and its LoRA adapter
switch; ``MegatronBackend`` and ``Fsdp2Backend`` subclass it, so ``reload``, ``offloaded``,
``set_adapters_enabled`` and ``adapters_enabled`` are written once. A backend of another
package need not: the abilities are Protocols (``strategies.backends.base``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

import attrs

from heads.errors import EngineStateError
from strategies.memory.storage_offload import OffloadedParts
from strategies.model.peft_lora import AdapterSwitch

#: The backend's optimizer type (a torch optimizer, or megatron's).
OptimizerT = TypeVar("OptimizerT")


@attrs.define(kw_only=True)
class BackendState(Generic[OptimizerT]):
    """A backend's optimizer, offloaded parts and adapter switch (built by its own methods)."""

    _optimizer: OptimizerT | None = attrs.field(default=None, init=False)
    _offloaded: OffloadedParts = attrs.field(factory=OffloadedParts, init=False)
    #: Whether LoRA adapters (``EngineConfig.lora``) take part in the forward.
    _adapter_switch: AdapterSwitch = attrs.field(factory=AdapterSwitch, init=False)

    def reload(self, parts: Iterable[str]) -> None:
        """Bring offloaded ``parts`` back onto the device, in place."""
        self._offloaded.reload(parts)

    def offloaded(self) -> frozenset[str]:
        return self._offloaded.names()

    def set_adapters_enabled(self, enabled: bool) -> None:
        self._adapter_switch.enabled = enabled

    def adapters_enabled(self) -> bool:
        return self._adapter_switch.enabled

    def _require_optimizer(self) -> OptimizerT:
        if self._optimizer is None:
            raise EngineStateError(
                "this engine has no optimizer (forward-only, or not initialised)"
            )
        return self._optimizer
