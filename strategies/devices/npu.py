"""Ascend NPU platform: HCCL process groups; contributes MindSpeed's ``repatch`` to Megatron.

torch_npu and MindSpeed are imported lazily, on Ascend hosts only: importing them patches
torch and megatron globally. MindSpeed's repatch must run before megatron's
``initialize_model_parallel`` (it wraps that function for context parallelism) and before the
model is built, and runs once per process for the same overrides, for every head.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import attrs
from typing_extensions import override

from heads.errors import DeviceUnavailableError
from heads.validation import bool_field
from strategies.devices.base import DevicePlatform, DeviceRuntime, MeshInitStep

if TYPE_CHECKING:
    from strategies.part_configs import PartsConfig

INSTALL_HINT = (
    "install the Ascend CANN toolkit, then `pip install torch-npu==<your torch version>` and "
    "MindSpeed from https://gitee.com/ascend/MindSpeed (see docs/backends.md, 'Installing on "
    "accelerator hosts')"
)

#: Overrides already applied, per MindSpeed adaptor module (a process has one).
_applied_repatches: dict[int, tuple[Any, set[str]]] = {}


def _overrides_key(overrides: Mapping[str, Any]) -> str:
    return repr(sorted(overrides.items()))


@runtime_checkable
class TransformerOverrides(Protocol):
    """A backend whose megatron transformer settings MindSpeed must see too."""

    @property
    def transformer_overrides(self) -> Mapping[str, Any]: ...


@attrs.define(kw_only=True)
class NpuPlatform(DevicePlatform):
    """Huawei Ascend NPUs through torch_npu (``torch.npu``)."""

    name: ClassVar[str] = "npu"
    device_type: ClassVar[str] = "npu"
    dist_backend: ClassVar[str] = "hccl"
    visible_devices_env: ClassVar[str | None] = "ASCEND_RT_VISIBLE_DEVICES"
    capabilities: ClassVar[frozenset[str]] = frozenset({"sequence_parallel", "context_parallel"})

    #: ``mindspeed.megatron_adaptor`` (or a double); imported on first use when None.
    mindspeed_adaptor: Any = None
    use_flash_attn: bool = bool_field(True)

    @override
    def load_runtime(self) -> DeviceRuntime:
        try:
            importlib.import_module("torch_npu")
        except Exception as error:  # torch_npu raises more than ImportError without CANN
            raise DeviceUnavailableError(
                f"npu: the NPU platform needs torch_npu and CANN; `import torch_npu` failed "
                f"with: {type(error).__name__}: {error}. To use it, {INSTALL_HINT}"
            ) from error
        import torch

        runtime: DeviceRuntime = torch.npu  # type: ignore[attr-defined]
        return runtime

    @override
    def no_device_reason(self) -> str:
        return f"npu: torch_npu loaded but sees no NPU ({self.visible_devices_env}); check npu-smi"

    @override
    def mesh_init_steps(self, backend_kind: str) -> tuple[MeshInitStep, ...]:
        """MindSpeed's repatch, for megatron-kind backends (whatever their registry name)."""
        return (self.repatch_mindspeed,) if backend_kind == "megatron" else ()

    def repatch_overrides(self, backend: object, config: PartsConfig) -> dict[str, Any]:
        """What MindSpeed re-applies its patches with: flash attention, context parallelism and
        the backend's own transformer overrides."""
        overrides: dict[str, Any] = {"use_flash_attn": self.use_flash_attn}
        if config.parallel.context_parallel_size > 1:
            overrides["context_parallel_size"] = config.parallel.context_parallel_size
        if isinstance(backend, TransformerOverrides):
            overrides.update(backend.transformer_overrides)
        return overrides

    def repatch_mindspeed(self, backend: object, config: PartsConfig) -> None:
        """Call ``mindspeed.megatron_adaptor.repatch`` unless done with these overrides already."""
        adaptor = self.load_mindspeed_adaptor()
        overrides = self.repatch_overrides(backend, config)
        _, applied = _applied_repatches.setdefault(id(adaptor), (adaptor, set()))
        key = _overrides_key(overrides)
        if key in applied:
            return
        adaptor.repatch(overrides)
        applied.add(key)

    def load_mindspeed_adaptor(self) -> Any:
        if self.mindspeed_adaptor is None:
            argv = sys.argv
            sys.argv = argv[:1]  # the adaptor parses sys.argv at import; keep our CLI's out of it
            try:
                self.mindspeed_adaptor = importlib.import_module("mindspeed.megatron_adaptor")
            except Exception as error:
                raise DeviceUnavailableError(
                    f"npu: Megatron on NPU needs MindSpeed; `import mindspeed.megatron_adaptor` "
                    f"failed with: {type(error).__name__}: {error}. To use it, {INSTALL_HINT}"
                ) from error
            finally:
                sys.argv = argv
        return self.mindspeed_adaptor
