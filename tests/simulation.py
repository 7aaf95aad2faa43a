"""Simulated device runtimes: real platform classes on this CPU with injected test doubles.

A CUDA or NPU cell is *simulated* here: the platform object is the real class, its device
module (``torch.cuda``/``torch.npu``-shaped) and process-group backend are replaced by doubles
(gloo, CPU tensors), and NPU's ``mindspeed.megatron_adaptor`` by a double that records
``repatch`` calls. Megatron then runs on CPU tensors, so the harness also turns on the CPU
compatibility layer, as the CPU platform would; real hardware does not need it.
"""

from __future__ import annotations

from typing import Any

import attrs
import psutil

from engine.registry import DEVICES
from strategies.devices.base import DevicePlatform
from strategies.megatron_support.cpu_compat import enable_megatron_cpu_compat


class EventLog(list[tuple[str, Any]]):
    """Ordered record of hook calls: ``("repatch", overrides)``, ``("initialize_model_parallel",
    sizes)``, ``("set_device", index)``."""

    def names(self) -> list[str]:
        return [name for name, _ in self]


class RecordingRuntime:
    """Stands in for ``torch.cuda`` / ``torch.npu``: one device, calls recorded."""

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def set_device(self, device: Any) -> None:
        self.log.append(("set_device", device))

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """The host's memory: a simulated device's tensors live there."""
        memory = psutil.virtual_memory()
        return memory.available, memory.total


class RecordingMindSpeedAdaptor:
    """Stands in for ``mindspeed.megatron_adaptor``: ``repatch`` calls recorded."""

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def repatch(self, overrides: dict[str, Any]) -> None:
        self.log.append(("repatch", dict(overrides)))


def forget_applied_repatches() -> None:
    """Forget which MindSpeed overrides the NPU platform applied (as in a fresh process)."""
    from strategies.devices import npu

    npu._applied_repatches.clear()


def make_platform(name: str, log: EventLog) -> tuple[DevicePlatform, bool]:
    """The registered platform ``name``: real where available here, else simulated.

    Returns the platform and whether it is simulated.
    """
    factory = DEVICES.get(name)
    real: DevicePlatform = factory()
    if real.availability().ok:
        return real, False
    injected: dict[str, Any] = {
        "runtime": RecordingRuntime(log),
        "process_group_backend": "gloo",
        "tensor_device": "cpu",
    }
    field_names = {field.name for field in attrs.fields(type(real))}
    if "mindspeed_adaptor" in field_names:
        injected["mindspeed_adaptor"] = RecordingMindSpeedAdaptor(log)
    enable_megatron_cpu_compat()
    return factory(**injected), True
