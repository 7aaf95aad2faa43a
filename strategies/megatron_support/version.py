"""The megatron-core releases this project is tested with, checked at start-up.

One range serves the megatron backend and the CPU platform's compatibility layer: both rely on
megatron internals that change between releases. pyproject.toml declares the same range.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

from heads.errors import VersionError

TESTED_MIN = Version("0.16.1")
TESTED_BELOW = Version("0.17")

_INSTALL = f"pip install 'megatron-core>={TESTED_MIN},<{TESTED_BELOW}'"


def check_megatron_version(needed_by: str = "the megatron backend") -> str:
    """The installed megatron-core version; a VersionError saying what ``needed_by`` is tested
    with and how to install it when megatron-core is missing or outside the range."""
    try:
        installed = version("megatron-core")
    except PackageNotFoundError:
        raise VersionError(
            f"{needed_by} needs megatron-core; install it with `{_INSTALL}`"
        ) from None
    if not TESTED_MIN <= Version(installed) < TESTED_BELOW:
        raise VersionError(
            f"megatron-core {installed} is installed, but {needed_by} is tested with "
            f">={TESTED_MIN},<{TESTED_BELOW} only (it relies on megatron internals that change "
            f"between releases); install it with `{_INSTALL}`"
        )
    return installed
