"""The megatron-core versions the CPU compatibility layer and this backend are tested with."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

from heads.errors import VersionError

TESTED_MIN = Version("0.16.1")
TESTED_BELOW = Version("0.17")


def check_megatron_version() -> str:
    """Return the installed megatron-core version, or raise VersionError saying what to do."""
    try:
        installed = version("megatron-core")
    except PackageNotFoundError:
        raise VersionError(
            "the megatron backend needs megatron-core; install it with "
            f"`pip install 'megatron-core>={TESTED_MIN},<{TESTED_BELOW}'`"
        ) from None
    if not TESTED_MIN <= Version(installed) < TESTED_BELOW:
        raise VersionError(
            f"megatron-core {installed} is installed, but this engine is tested with "
            f">={TESTED_MIN},<{TESTED_BELOW} (its internals change between releases); install "
            f"`pip install 'megatron-core>={TESTED_MIN},<{TESTED_BELOW}'`"
        )
    return installed
