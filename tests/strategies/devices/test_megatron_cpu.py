"""The CPU layer: the megatron-core releases it accepts."""

from __future__ import annotations

import pytest

from heads.errors import VersionError
from strategies import megatron_version
from strategies.devices import megatron_cpu
from strategies.devices.megatron_cpu import enable_megatron_cpu_compat


def test_a_megatron_core_outside_the_tested_range_is_refused_naming_the_cpu_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(megatron_cpu._state, "enabled", False)
    monkeypatch.setattr(megatron_version, "version", lambda package: "0.15.3")
    with pytest.raises(VersionError) as raised:
        enable_megatron_cpu_compat()
    assert str(raised.value).startswith(
        "megatron-core 0.15.3 is installed, but the megatron-core CPU compatibility layer is "
        "tested with >=0.16.1,<0.17 only"
    )
    assert "pip install 'megatron-core>=0.16.1,<0.17'" in str(raised.value)
