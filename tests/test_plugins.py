"""Adding a head, a backend and a device platform is a pure addition: each is defined here,
outside the packages, registered by name, and runs in the same Engine with no edit to engine/.

A megatron backend subclass under another name is still a megatron-kind backend: the CPU
platform contributes its compatibility layer and the (simulated) NPU platform MindSpeed's
repatch, once and before mesh init, for every head.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import pytest
import torch

from engine import Engine, register_backend, register_device, register_head
from engine.losses import sft_loss
from engine.registry import BACKENDS, DEVICES, HEADS
from heads.base import (
    PER_SEQUENCE,
    PER_TOKEN,
    Granularity,
    HeadContext,
    OutputSpec,
    at_last_token,
    shift_to_scored_token,
)
from heads.errors import ConfigError
from strategies.backends.base import Backend
from strategies.backends.megatron.backend import MegatronBackend
from strategies.devices.base import MeshInitStep
from strategies.devices.cpu import CpuPlatform
from tests.factories import raise_outputs_loss, random_batch, tiny_model
from tests.simulation import EventLog, make_platform

HEAD_NAMES = ("lm", "value", "reward", "plugin-running-mean")


@attrs.frozen(kw_only=True)
class RunningMeanHead:
    """A research head: per token, the running mean of a scalar read-out; per sequence, the
    read-out at the last token."""

    name: ClassVar[str] = "plugin-running-mean"

    @property
    def outputs(self) -> dict[str, Granularity]:
        return {"running_mean": PER_TOKEN, "final": PER_SEQUENCE}

    def output_spec(self) -> OutputSpec:
        return OutputSpec(kind="replicated", features=1)

    def postprocess(
        self, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        scalar = raw[..., 0].float()
        steps = torch.arange(1, scalar.shape[1] + 1, device=scalar.device)
        running = scalar.cumsum(1) / steps
        return {"running_mean": shift_to_scored_token(running), "final": at_last_token(scalar, ctx)}


class PluginMegatron(MegatronBackend):
    """A team's megatron variant, registered under its own name."""

    name: ClassVar[str] = "plugin-megatron"


@attrs.define(kw_only=True)
class TracingCpu(CpuPlatform):
    """A CPU platform that also records each megatron-kind mesh init it takes part in."""

    name: ClassVar[str] = "plugin-tracing-cpu"
    seen: list[str] = attrs.field(factory=list)

    def mesh_init_steps(self, backend_kind: str) -> tuple[MeshInitStep, ...]:
        def trace(backend: Any, config: Any) -> None:
            self.seen.append(type(backend).__name__)

        return (*super().mesh_init_steps(backend_kind), trace)


@pytest.fixture(scope="module", autouse=True)
def plugins() -> Iterator[None]:
    register_head(RunningMeanHead.name)(RunningMeanHead)
    register_backend(PluginMegatron.name)(PluginMegatron)
    register_device(TracingCpu.name)(TracingCpu)
    yield
    HEADS.unregister(RunningMeanHead.name)
    BACKENDS.unregister(PluginMegatron.name)
    DEVICES.unregister(TracingCpu.name)


@pytest.fixture
def cpu_layer_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each time a platform turns on megatron's CPU compatibility layer."""
    from strategies.megatron_support import cpu_compat

    calls: list[str] = []
    original = cpu_compat.enable_megatron_cpu_compat

    def recording() -> None:
        calls.append("enable")
        original()

    monkeypatch.setattr(cpu_compat, "enable_megatron_cpu_compat", recording)
    return calls


def train_and_infer(engine: Engine) -> dict[str, Any]:
    batch = random_batch([5, 3, 7], 64, seed=3)
    with engine.train_mode():
        losses = [engine.train_batch(batch, raise_outputs_loss)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    outputs = engine.infer_batch(batch)
    assert set(outputs.keys()) == set(engine.head.outputs)
    return dict(outputs.items())


@pytest.mark.parametrize("head", HEAD_NAMES)
def test_a_megatron_subclass_under_another_name_gets_the_cpu_layer_for_every_head(
    fresh_mesh: None, cpu_layer_calls: list[str], head: str
) -> None:
    engine = Engine.build(
        head=head, backend="plugin-megatron", device="cpu", config={"model": tiny_model()}
    )
    assert isinstance(engine.backend, PluginMegatron)
    engine.initialize()
    assert cpu_layer_calls == ["enable"]
    train_and_infer(engine)


@pytest.mark.parametrize("head", HEAD_NAMES)
def test_a_megatron_subclass_under_another_name_gets_the_npu_repatch_once_before_mesh_init(
    event_log: EventLog, head: str
) -> None:
    platform, simulated = make_platform("npu", event_log)
    if not simulated:
        pytest.skip("a real NPU is present; the recording MindSpeed double is not in use")
    backend = PluginMegatron(transformer_overrides={"hidden_dropout": 0.0})
    engine = Engine.build(
        head=head, backend=backend, device=platform, config={"model": tiny_model()}
    )
    engine.initialize()
    names = event_log.names()
    assert names.count("repatch") == 1
    assert names.index("repatch") < names.index("initialize_model_parallel")
    repatch = next(value for name, value in event_log if name == "repatch")
    assert repatch == {"use_flash_attn": True, "hidden_dropout": 0.0}
    train_and_infer(engine)


def test_a_plugin_head_is_built_by_name_and_its_outputs_follow_its_declaration(
    fresh_mesh: None,
) -> None:
    engine = Engine.build(
        head="plugin-running-mean", device="cpu", config={"model": tiny_model()}
    ).initialize()
    outputs = train_and_infer(engine)
    assert outputs["final"].shape == (3,)
    assert [len(row) for row in outputs["running_mean"].unbind()] == [5, 3, 7]


def test_a_plugin_platform_is_built_by_name_and_contributes_by_backend_kind(
    fresh_mesh: None, cpu_layer_calls: list[str]
) -> None:
    engine = Engine.build(
        head="value",
        backend="plugin-megatron",
        device="plugin-tracing-cpu",
        config={"model": tiny_model()},
    ).initialize()
    assert isinstance(engine.platform, TracingCpu)
    assert engine.platform.seen == ["PluginMegatron"]
    assert cpu_layer_calls == ["enable"]  # the CpuPlatform's own step is inherited
    train_and_infer(engine)


class CoreOnlyBackend:
    """A backend wrapper that offers exactly the ``Backend`` protocol and no optional ability;
    it declares the megatron kind, so platforms treat it as megatron."""

    name: ClassVar[str] = "plugin-core-only"
    kind: ClassVar[str] = "megatron"

    def __init__(self) -> None:
        self.inner = MegatronBackend()


for _method in [
    name for name, value in vars(Backend).items() if callable(value) and name[0] != "_"
]:

    def _delegate(self: CoreOnlyBackend, *args: Any, _name: str = _method, **kwargs: Any) -> Any:
        return getattr(self.inner, _name)(*args, **kwargs)

    setattr(CoreOnlyBackend, _method, _delegate)


def test_a_backend_without_an_ability_is_refused_naming_the_ability_and_the_backend(
    fresh_mesh: None,
) -> None:
    engine = Engine(
        head=HEADS.create("lm"),
        backend=CoreOnlyBackend(),
        platform=DEVICES.create("cpu"),
        config={"model": tiny_model()},
    ).initialize()
    assert engine.train_batch(random_batch([4, 6], 64), sft_loss)["loss"] > 0
    with pytest.raises(ConfigError, match=r"plugin-core-only backend lacks the 'offload'"):
        Engine(
            head=HEADS.create("lm"),
            backend=CoreOnlyBackend(),
            platform=DEVICES.create("cpu"),
            config={"model": tiny_model(), "offload": {"optimizer": True}},
        )
    with pytest.raises(ConfigError, match=r"plugin-core-only backend lacks the 'lora'"):
        Engine(
            head=HEADS.create("lm"),
            backend=CoreOnlyBackend(),
            platform=DEVICES.create("cpu"),
            config={"model": tiny_model(), "lora": {"rank": 4}},
        )
    for call, ability in (
        (lambda: engine.save_checkpoint("/nonexistent"), "checkpoints"),
        (lambda: engine.load_checkpoint("/nonexistent"), "checkpoints"),
        (lambda: list(engine.get_per_tensor_param()), "huggingface_export"),
        (lambda: list(engine.get_per_tensor_param_shard()), "sharded_export"),
        (lambda: engine.to("cpu"), "offload"),
    ):
        with pytest.raises(ConfigError, match=rf"plugin-core-only backend lacks the '{ability}'"):
            call()
    assert engine.train_batch(random_batch([4, 6], 64), sft_loss)["loss"] > 0


def test_requiring_an_ability_outside_the_named_table_names_its_protocol() -> None:
    """``require`` takes any ability protocol (``DeferredGradNorm`` is not in ``ABILITIES``,
    the table ``matrix`` shows), and a backend without it is refused by the protocol's name."""
    from strategies.backends.base import ABILITIES, DeferredGradNorm, require

    assert DeferredGradNorm not in ABILITIES.values()
    with pytest.raises(ConfigError, match=r"lacks the 'DeferredGradNorm' ability"):
        require(CoreOnlyBackend(), DeferredGradNorm)
