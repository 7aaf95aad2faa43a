"""One megatron-core range, for the backend and the CPU layer alike, as pyproject.toml declares."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from heads.errors import VersionError
from strategies.megatron_support import version as megatron_version
from strategies.megatron_support.version import TESTED_BELOW, TESTED_MIN, check_megatron_version

ROOT = Path(__file__).resolve().parents[3]
INSTALL = "pip install 'megatron-core>=0.16.1,<0.17'"


def installed_as(monkeypatch: pytest.MonkeyPatch, found: str | None) -> None:
    """Make the check see megatron-core ``found`` (``None``: not installed)."""

    def fake_version(package: str) -> str:
        assert package == "megatron-core"
        if found is None:
            raise PackageNotFoundError(package)
        return found

    monkeypatch.setattr(megatron_version, "version", fake_version)


def test_the_installed_megatron_core_is_in_the_tested_range() -> None:
    assert check_megatron_version() == version("megatron-core")


@pytest.mark.parametrize("found", ["0.16.1", "0.16.2", "0.16.10"])
def test_every_release_in_the_range_is_accepted(
    monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    installed_as(monkeypatch, found)
    assert check_megatron_version() == found


@pytest.mark.parametrize("found", ["0.15.3", "0.16.0", "0.16.1rc1", "0.17.0"])
def test_a_release_outside_the_range_is_refused_naming_it_the_range_and_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    installed_as(monkeypatch, found)
    with pytest.raises(VersionError) as raised:
        check_megatron_version("the CPU layer")
    message = str(raised.value)
    assert f"megatron-core {found} is installed" in message
    assert "the CPU layer is tested with >=0.16.1,<0.17" in message
    assert INSTALL in message


def test_a_missing_megatron_core_is_refused_with_the_pip_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed_as(monkeypatch, None)
    with pytest.raises(VersionError, match="the megatron backend needs megatron-core") as raised:
        check_megatron_version()
    assert INSTALL in str(raised.value)


def test_pyproject_declares_the_range_and_the_cpu_constraints_pin_a_release_in_it() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (declared,) = (
        r for r in map(Requirement, project["dependencies"]) if r.name == "megatron-core"
    )
    assert declared.specifier == SpecifierSet(f">={TESTED_MIN},<{TESTED_BELOW}")
    lines = (ROOT / "constraints-cpu.txt").read_text().splitlines()
    constraints = [Requirement(line) for line in lines if line and not line.startswith("#")]
    (pin,) = (r for r in constraints if r.name == "megatron-core")
    (pinned,) = pin.specifier
    assert pinned.operator == "=="
    assert pinned.version in declared.specifier
