"""Registries: lazy built-ins, user registration, plugins, helpful unknown-name errors."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint
from typing import ClassVar

import attrs
import pytest
import torch

from engine.registry import HEADS, PluginLoadError, Registry, register_head
from heads.base import PER_TOKEN, Granularity, HeadContext, OutputSpec, shift_to_scored_token
from heads.errors import ConfigError, UnknownStrategyError


@attrs.frozen(kw_only=True)
class RewardHead:
    """A user's head: a score per token, from a replicated layer."""

    name: ClassVar[str] = "reward"
    scale: float = 1.0

    @property
    def outputs(self) -> dict[str, Granularity]:
        return {"scores": PER_TOKEN}

    def output_spec(self) -> OutputSpec:
        return OutputSpec(kind="replicated", features=1)

    def postprocess(
        self, raw: torch.Tensor, input_ids: torch.Tensor, ctx: HeadContext
    ) -> dict[str, torch.Tensor]:
        return {"scores": shift_to_scored_token(raw[..., 0].float() * self.scale)}


def test_importing_engine_imports_neither_megatron_nor_npu_packages() -> None:
    code = (
        "import sys, engine; "
        "heavy = ('megatron', 'torch_npu', 'mindspeed', 'transformers', 'safetensors');"
        "bad = [m for m in sys.modules if m.split('.')[0] in heavy];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_unknown_name_lists_known_names_and_suggests_the_closest() -> None:
    with pytest.raises(UnknownStrategyError) as caught:
        HEADS.get("valeu")
    message = str(caught.value)
    assert "did you mean 'value'?" in message
    assert "lm" in message and "value" in message


def test_registered_head_is_built_by_name_with_options_from_config() -> None:
    registry: Registry[object] = Registry("head", "composable_engine.test_heads", {})
    registry.register("reward")(RewardHead)
    head = registry.create("reward", {"scale": 2.0})
    assert head == RewardHead(scale=2.0)


def test_unknown_part_options_are_rejected_naming_the_key() -> None:
    registry: Registry[object] = Registry("head", "composable_engine.test_heads", {})
    registry.register("reward", RewardHead)
    with pytest.raises(ConfigError, match="scael"):
        registry.create("reward", {"scael": 2.0})


def test_duplicate_names_are_rejected_unless_overridden() -> None:
    registry: Registry[object] = Registry(
        "head", "composable_engine.test_heads", {"lm": "heads.lm:LMHead"}
    )
    with pytest.raises(ConfigError, match="already registered"):
        registry.register("lm", RewardHead)
    registry.register("lm", RewardHead, override=True)
    assert registry.get("lm") is RewardHead


def test_register_head_decorator_adds_to_the_global_registry() -> None:
    try:
        register_head("reward-test")(RewardHead)
        assert "reward-test" in HEADS.names()
        assert HEADS.get("reward-test") is RewardHead
    finally:
        HEADS.unregister("reward-test")


def test_a_broken_plugin_fails_alone_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = [
        EntryPoint("broken", "no_such_module_xyz:Head", "composable_engine.test_heads"),
        EntryPoint("good", "tests.engine.test_registry:RewardHead", "composable_engine.test_heads"),
    ]
    monkeypatch.setattr(
        "engine.registry.entry_points", lambda group: [p for p in plugins if p.group == group]
    )
    registry: Registry[object] = Registry(
        "head", "composable_engine.test_heads", {"lm": "heads.lm:LMHead"}
    )
    assert registry.names() == ["broken", "good", "lm"]
    assert registry.get("good") is RewardHead
    with pytest.raises(PluginLoadError, match="no_such_module_xyz"):
        registry.get("broken")
    assert registry.get("lm").__name__ == "LMHead"


def test_a_plugin_does_not_shadow_a_built_in_of_the_same_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugins = [
        EntryPoint("lm", "tests.engine.test_registry:RewardHead", "composable_engine.test_heads")
    ]
    monkeypatch.setattr("engine.registry.entry_points", lambda group: plugins)
    registry: Registry[object] = Registry(
        "head", "composable_engine.test_heads", {"lm": "heads.lm:LMHead"}
    )
    assert registry.get("lm").__name__ == "LMHead"
