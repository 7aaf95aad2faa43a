"""A CPU platform for verl (``verl.plugin.platform``): verl's process-group and device lookups
(``get_device_name``, ``get_nccl_backend``, ``get_torch_device``) then work without an
accelerator. Registered as ``cpu``; auto-detected only where no accelerator platform is (verl
probes its built-in platforms first), or forced with ``VERL_PLATFORM=cpu``."""

from __future__ import annotations

import contextlib
import importlib.util
import types
from collections.abc import Iterator
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

NAME = "cpu"


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module (memory
    statistics, seeding, cache and allocator control), answered as a host has them."""

    def __init__(self) -> None:
        super().__init__("verl_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def max_memory_allocated(*args: Any, **kwargs: Any) -> int:
        return 0

    max_memory_reserved = memory_allocated = memory_reserved = max_memory_allocated

    @staticmethod
    def mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
        import psutil

        memory = psutil.virtual_memory()
        return memory.available, memory.total

    @staticmethod
    def reset_peak_memory_stats(*args: Any, **kwargs: Any) -> None:
        return None

    empty_cache = ipc_collect = reset_peak_memory_stats

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device_name(*args: Any, **kwargs: Any) -> str:
        return "CPU"  # verl's FLOPs table knows it (MFU on CPU)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None


DEVICE_MODULE = _CpuDeviceModule()


def process_group_backend() -> str:
    """verl's backend string with each device type once (``"cpu:gloo"`` on this platform):
    verl's own, ``"cpu:gloo,<device>:<backend>"``, names ``cpu`` twice here, which torch
    refuses."""
    from verl.utils.device import get_device_name, get_nccl_backend

    return ",".join(dict.fromkeys(["cpu:gloo", f"{get_device_name()}:{get_nccl_backend()}"]))


def accelerator_present() -> bool:
    """Whether this host has an accelerator verl would use instead (CUDA/ROCm or Ascend)."""
    return torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None


@PlatformRegistry.register(platform=NAME)
class CpuPlatform(PlatformBase):
    """verl's platform interface on plain CPUs: gloo collectives, no profiler, no IPC."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return not accelerator_present()

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
