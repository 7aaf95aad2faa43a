"""Device platforms: identity, availability, auto selection, and their mesh-init contributions."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import psutil
import pytest
import torch

from engine import Engine
from engine.config import EngineConfig
from engine.registry import resolve_device
from heads.errors import ConfigError, DeviceUnavailableError
from strategies.backends.megatron.backend import MegatronBackend
from strategies.devices.base import Availability
from strategies.devices.cpu import CpuPlatform
from strategies.devices.cuda import CudaPlatform
from strategies.devices.npu import NpuPlatform
from tests.factories import random_batch, tiny_model
from tests.simulation import EventLog, RecordingMindSpeedAdaptor, RecordingRuntime

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


def simulated_npu(log: EventLog, **options: Any) -> NpuPlatform:
    return NpuPlatform(
        runtime=RecordingRuntime(log),
        process_group_backend="gloo",
        tensor_device="cpu",
        mindspeed_adaptor=RecordingMindSpeedAdaptor(log),
        **options,
    )


@pytest.mark.parametrize(
    ("platform", "device_type", "backend", "visible"),
    [
        (CpuPlatform, "cpu", "gloo", None),
        (CudaPlatform, "cuda", "nccl", "CUDA_VISIBLE_DEVICES"),
        (NpuPlatform, "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"),
    ],
)
def test_each_platform_declares_device_type_process_group_backend_and_visible_devices_variable(
    platform: type, device_type: str, backend: str, visible: str | None
) -> None:
    assert (platform.device_type, platform.dist_backend, platform.visible_devices_env) == (
        device_type,
        backend,
        visible,
    )


def test_cpu_platform_is_always_available() -> None:
    assert CpuPlatform().availability() == Availability(True)


@needs_no_cuda
def test_cuda_requested_on_a_cpu_only_torch_fails_at_build_time_saying_what_to_install() -> None:
    with pytest.raises(DeviceUnavailableError, match=r"CPU-only build.*install a CUDA build"):
        Engine.build(head="value", device="cuda")


def test_npu_requested_without_torch_npu_fails_at_build_time_saying_what_is_missing() -> None:
    with pytest.raises(DeviceUnavailableError) as caught:
        Engine.build(head="value", device="npu")
    message = str(caught.value)
    assert "torch_npu and CANN" in message
    assert "import torch_npu" in message
    assert "MindSpeed" in message


@needs_no_cuda
def test_auto_falls_back_to_cpu_when_neither_cuda_nor_npu_is_usable() -> None:
    assert isinstance(resolve_device("auto", {}), CpuPlatform)


@pytest.mark.parametrize(
    ("usable", "expected"),
    [({"cuda", "npu"}, CudaPlatform), ({"npu"}, NpuPlatform), (set(), CpuPlatform)],
)
def test_auto_prefers_cuda_then_npu_then_cpu(
    monkeypatch: pytest.MonkeyPatch, usable: set[str], expected: type
) -> None:
    for platform in (CudaPlatform, NpuPlatform):
        state = Availability(platform.name in usable, f"{platform.name} absent")
        monkeypatch.setattr(platform, "availability", lambda self, state=state: state)
    assert type(resolve_device("auto", {})) is expected


@pytest.mark.parametrize("usable", [{"cuda", "npu"}, {"npu"}, set()])
def test_auto_gives_the_chosen_platform_the_options_it_takes_and_refuses_the_rest(
    monkeypatch: pytest.MonkeyPatch, usable: set[str]
) -> None:
    for platform in (CudaPlatform, NpuPlatform):
        state = Availability(platform.name in usable, f"{platform.name} absent")
        monkeypatch.setattr(platform, "availability", lambda self, state=state: state)
    shared = {"process_group_backend": "gloo", "tensor_device": "meta"}
    chosen = resolve_device("auto", shared)
    assert (chosen.process_group_backend, chosen.tensor_device) == ("gloo", "meta")
    npu_only = {**shared, "use_flash_attn": False}
    if "cuda" not in usable and "npu" in usable:
        npu = resolve_device("auto", npu_only)
        assert isinstance(npu, NpuPlatform) and npu.use_flash_attn is False
        return
    with pytest.raises(ConfigError, match=r"chose c[a-z]+, which takes no option use_flash_att"):
        resolve_device("auto", npu_only)
    with pytest.raises(ConfigError, match=r"no option use_flash_atn \(no platform does\)"):
        resolve_device("auto", {"use_flash_atn": False})


class MeasuredRuntime(RecordingRuntime):
    """A device runtime with 3 GiB of its 80 free."""

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self.log.append(("mem_get_info", device))
        return 3 * 2**30, 80 * 2**30


def test_an_accelerator_offers_the_free_memory_of_this_process_s_device() -> None:
    for platform, where in ((CudaPlatform(), "cuda:1"), (NpuPlatform(tensor_device="cpu"), "cpu")):
        log = EventLog()
        platform.runtime = MeasuredRuntime(log)
        platform.local_rank = 1
        assert platform.memory_available() == 3 * 2**30
        assert log == [("mem_get_info", torch.device(where))]


def test_the_cpu_offers_the_host_s_available_memory() -> None:
    assert 0 < CpuPlatform().memory_available() <= psutil.virtual_memory().total


def test_npu_repatch_runs_once_per_process_for_the_same_overrides() -> None:
    log = EventLog()
    platform = simulated_npu(log)
    config = EngineConfig()
    for _ in range(3):
        platform.repatch_mindspeed(MegatronBackend(), config)
    assert log == [("repatch", {"use_flash_attn": True})]

    platform.repatch_mindspeed(MegatronBackend(transformer_overrides={"x": 1}), config)
    assert log[-1] == ("repatch", {"use_flash_attn": True, "x": 1})
    assert len(log) == 2


def test_npu_repatch_overrides_carry_context_parallel_size_and_user_transformer_overrides() -> None:
    log = EventLog()
    config = EngineConfig.from_dict(
        {"parallel": {"context_parallel_size": 2}, "model": tiny_model()}
    )
    backend = MegatronBackend(transformer_overrides={"recompute_granularity": "full"})
    simulated_npu(log, use_flash_attn=False).repatch_mindspeed(backend, config)
    assert log == [
        (
            "repatch",
            {"use_flash_attn": False, "context_parallel_size": 2, "recompute_granularity": "full"},
        )
    ]


@pytest.mark.parametrize("head", ["lm", "value"])
def test_npu_repatch_runs_before_initialize_model_parallel_and_model_build_for_every_head(
    event_log: EventLog, head: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from strategies.backends.megatron import backend as megatron_backend

    original_build = megatron_backend.build_gpt_model

    def recording_build(*args: Any, **kwargs: Any) -> Any:
        event_log.append(("build_model", None))
        return original_build(*args, **kwargs)

    monkeypatch.setattr(megatron_backend, "build_gpt_model", recording_build)
    from strategies.megatron_support.cpu_compat import enable_megatron_cpu_compat

    enable_megatron_cpu_compat()
    engine = Engine.build(
        head=head, device=simulated_npu(event_log), config={"model": tiny_model()}
    ).initialize()
    names = event_log.names()
    assert names.count("repatch") == 1
    assert names.index("repatch") < names.index("initialize_model_parallel")
    assert names.index("initialize_model_parallel") < names.index("build_model")
    assert engine.infer_batch(random_batch([4, 6], 64)) is not None


def test_cuda_platform_contributes_nothing_to_megatron_mesh_init() -> None:
    assert CudaPlatform().mesh_init_steps("megatron") == ()


def test_mindspeed_import_failure_is_a_device_error_naming_mindspeed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mindspeed", None)  # makes the import fail
    platform = NpuPlatform(runtime=RecordingRuntime(EventLog()), tensor_device="cpu")
    with pytest.raises(
        DeviceUnavailableError, match=r"needs MindSpeed.*mindspeed\.megatron_adaptor"
    ):
        platform.repatch_mindspeed(MegatronBackend(), EngineConfig())


def test_mindspeed_import_does_not_see_the_programs_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "mindspeed"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "megatron_adaptor.py").write_text(
        textwrap.dedent(
            """
            import sys
            seen_argv = list(sys.argv)
            calls = []
            def repatch(overrides):
                calls.append(dict(overrides))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["prog", "--steps", "3"])
    platform = NpuPlatform(runtime=RecordingRuntime(EventLog()), tensor_device="cpu")
    platform.repatch_mindspeed(MegatronBackend(), EngineConfig())
    adaptor = platform.mindspeed_adaptor
    assert adaptor.seen_argv == ["prog"]
    assert adaptor.calls == [{"use_flash_attn": True}]
    assert sys.argv == ["prog", "--steps", "3"]
    for name in ("mindspeed.megatron_adaptor", "mindspeed"):
        sys.modules.pop(name, None)


class PlainCpuPlatform(CpuPlatform):
    """A research platform that offers no optional feature."""

    name: ClassVar[str] = "plain-cpu"
    capabilities: ClassVar[frozenset[str]] = frozenset()


def test_features_the_platform_does_not_offer_are_rejected_at_build_naming_the_platform() -> None:
    parallel = {"sequence_parallel": True, "context_parallel_size": 2}
    with pytest.raises(
        ConfigError,
        match=r"context_parallel, sequence_parallel is not supported by the plain-cpu platform",
    ):
        Engine.build(head="lm", device=PlainCpuPlatform(), config={"parallel": parallel})


def test_sequence_and_context_parallelism_build_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU runs both (the layouts are compared to one process in
    tests/engine/test_parallel.py and test_moe_parallel.py)."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as a 2-rank launch: CP=2 fits
    parallel = {"sequence_parallel": True, "context_parallel_size": 2}
    engine = Engine.build(head="lm", device="cpu", config={"parallel": parallel})
    assert engine.config.parallel.context_parallel_size == 2
