"""CUDA platform: NCCL process groups; megatron-core needs no contribution on CUDA."""

from __future__ import annotations

import os
from typing import ClassVar

import attrs
import torch
from typing_extensions import override

from heads.errors import DeviceUnavailableError
from strategies.devices.base import DevicePlatform, DeviceRuntime


@attrs.define(kw_only=True)
class CudaPlatform(DevicePlatform):
    """NVIDIA GPUs through ``torch.cuda``."""

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"
    visible_devices_env: ClassVar[str | None] = "CUDA_VISIBLE_DEVICES"
    capabilities: ClassVar[frozenset[str]] = frozenset({"sequence_parallel", "context_parallel"})

    @override
    def load_runtime(self) -> DeviceRuntime:
        if torch.version.cuda is None:
            raise DeviceUnavailableError(
                f"cuda: this torch ({torch.__version__}) is a CPU-only build; install a CUDA "
                "build on a GPU host, e.g. `pip install torch --index-url "
                "https://download.pytorch.org/whl/cu128`"
            )
        return torch.cuda

    @override
    def no_device_reason(self) -> str:
        visible = os.environ.get(self.visible_devices_env or "", "<unset>")
        return (
            f"cuda: torch is a CUDA build but sees no GPU ({self.visible_devices_env}={visible}); "
            "check the driver with `nvidia-smi`"
        )
