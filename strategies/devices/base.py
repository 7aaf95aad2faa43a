"""The DevicePlatform base: device runtime, process-group backend and mesh-init contributions.

A platform's identity is class attributes; behaviour is small methods. Its runtime (the
``torch.cuda``-shaped device module) is loaded lazily, so constructing a platform imports
nothing heavy, and tests can inject a double for it (``runtime=``), together with the
process-group backend (``process_group_backend=``) and the device tensors live on
(``tensor_device=``): that is how CUDA and NPU cells are simulated on a CPU machine.
"""

from __future__ import annotations

import abc
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import attrs
import torch
import torch.distributed as dist

from heads.errors import DeviceUnavailableError

if TYPE_CHECKING:
    from strategies.part_configs import PartsConfig


class DeviceRuntime(Protocol):
    """The part of a ``torch.cuda``-shaped device module the engine uses."""

    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def set_device(self, device: Any) -> None: ...


@runtime_checkable
class DeviceMemory(Protocol):
    """A device module that reports its memory (``torch.cuda``, ``torch.npu``)."""

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of ``device``'s memory."""
        ...


class BackendKind(Protocol):
    """What a platform reads of a backend: its declared ``kind`` (e.g. ``"megatron"``), which a
    subclass registered under another name inherits (backends are not imported here)."""

    @property
    def kind(self) -> str: ...


#: A platform's contribution to the mesh init of backends of one kind: called with the backend
#: and the engine config, strictly before the backend's ``init_mesh``.
MeshInitStep = Callable[[Any, "PartsConfig"], None]


@attrs.frozen
class Availability:
    """Whether a platform can run here, and if not, why and what to do."""

    ok: bool
    reason: str = ""


@attrs.define(kw_only=True)
class DevicePlatform(abc.ABC):
    """Where an engine runs. Subclasses: ``cpu``, ``cuda``, ``npu`` (one file each)."""

    name: ClassVar[str]
    #: ``torch.device`` type tensors are placed on.
    device_type: ClassVar[str]
    #: Default ``torch.distributed`` backend of this device.
    dist_backend: ClassVar[str]
    #: Environment variable that restricts the visible devices.
    visible_devices_env: ClassVar[str | None]
    #: Features backends may require of a platform (see ``Backend.required_capabilities``).
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: The device's memory is the host's (the CPU): what a backend would offload to host memory
    #: is there already.
    memory_is_host: ClassVar[bool] = False

    runtime: DeviceRuntime | None = None
    process_group_backend: str | None = None
    tensor_device: str | None = None
    local_rank: int = attrs.field(default=0, init=False)

    # -- identity and availability -------------------------------------------------------------
    @abc.abstractmethod
    def load_runtime(self) -> DeviceRuntime:
        """Import the device module; raise DeviceUnavailableError saying what is missing."""

    def device_runtime(self) -> DeviceRuntime:
        if self.runtime is None:
            self.runtime = self.load_runtime()
        return self.runtime

    def availability(self) -> Availability:
        """Probe without side effects beyond importing the device module."""
        try:
            runtime = self.device_runtime()
        except DeviceUnavailableError as error:
            return Availability(False, str(error))
        if not runtime.is_available() or runtime.device_count() < 1:
            return Availability(False, self.no_device_reason())
        return Availability(True)

    def no_device_reason(self) -> str:
        return f"{self.name}: the runtime loaded but reports no usable device"

    def require_available(self) -> None:
        state = self.availability()
        if not state.ok:
            raise DeviceUnavailableError(state.reason)

    # -- setup ---------------------------------------------------------------------------------
    @property
    def backend_for_process_group(self) -> str:
        return self.process_group_backend or self.dist_backend

    def torch_device(self) -> torch.device:
        if self.tensor_device is not None:
            return torch.device(self.tensor_device)
        return torch.device(self.device_type, self.local_rank)

    def setup(self, local_rank: int) -> torch.device:
        """Select this process's device and make sure the default process group exists."""
        self.require_available()
        self.local_rank = local_rank
        self.select_device()
        if not dist.is_initialized():
            init_default_process_group(self.backend_for_process_group)
        return self.torch_device()

    def select_device(self) -> None:
        self.device_runtime().set_device(self.local_rank)

    def memory_available(self) -> int | None:
        """Bytes this process's device can still allocate (after ``setup``): what a model's
        size is checked against before it is built. None where the runtime cannot tell."""
        runtime = self.device_runtime()
        if not isinstance(runtime, DeviceMemory):
            return None
        free, _ = runtime.mem_get_info(self.torch_device())
        return int(free)

    # -- contributions to backends -------------------------------------------------------------
    def mesh_init_steps(self, backend_kind: str) -> tuple[MeshInitStep, ...]:
        """What this platform contributes to the mesh init of ``backend_kind`` backends
        (default: nothing)."""
        return ()

    def before_mesh_init(self, backend: BackendKind, config: PartsConfig) -> None:
        """Run this platform's contributions for ``backend``'s kind, before its mesh init."""
        for step in self.mesh_init_steps(backend.kind):
            step(backend, config)


def init_default_process_group(backend: str) -> None:
    """Create the default process group from torchrun-style variables, or a world of one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        init_method = "env://"
    elif world_size == 1:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    else:
        raise DeviceUnavailableError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set; launch with "
            "torchrun or set them for every rank"
        )
    dist.init_process_group(
        backend=backend, init_method=init_method, world_size=world_size, rank=rank
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
