"""CPU platform: gloo process groups; contributes megatron-core's CPU compatibility layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs
import psutil
import torch
from typing_extensions import override

from strategies.devices.base import DevicePlatform, DeviceRuntime, MeshInitStep

if TYPE_CHECKING:
    from strategies.part_configs import PartsConfig


def _enable_megatron_on_cpu(backend: object, config: PartsConfig) -> None:
    from strategies.megatron_support.cpu_compat import enable_megatron_cpu_compat

    enable_megatron_cpu_compat()


#: What the CPU contributes, by backend kind: megatron-core needs its CPU compatibility layer
#: (it assumes CUDA in many places).
MESH_INIT_STEPS: dict[str, tuple[MeshInitStep, ...]] = {"megatron": (_enable_megatron_on_cpu,)}


@attrs.define(kw_only=True)
class CpuPlatform(DevicePlatform):
    """Plain CPUs; always available. Sequence and context parallelism run (gloo has the
    all-gather and reduce-scatter they need)."""

    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    visible_devices_env: ClassVar[str | None] = None
    capabilities: ClassVar[frozenset[str]] = frozenset({"sequence_parallel", "context_parallel"})
    memory_is_host: ClassVar[bool] = True

    @override
    def load_runtime(self) -> DeviceRuntime:
        return torch.cpu

    @override
    def select_device(self) -> None:
        """A CPU process has one device; nothing to select."""

    @override
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    @override
    def memory_available(self) -> int:
        """The host's available memory (``torch.cpu`` has no ``mem_get_info``)."""
        return int(psutil.virtual_memory().available)

    @override
    def mesh_init_steps(self, backend_kind: str) -> tuple[MeshInitStep, ...]:
        return MESH_INIT_STEPS.get(backend_kind, ())
