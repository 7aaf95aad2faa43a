"""Public home of the exception hierarchy (defined in ``heads.errors``, the bottom layer)."""

from heads.errors import (
    BatchError,
    CheckpointError,
    ConfigError,
    DeviceUnavailableError,
    EngineError,
    EngineStateError,
    NonFiniteError,
    UnknownStrategyError,
    VersionError,
)

__all__ = [
    "BatchError",
    "CheckpointError",
    "ConfigError",
    "DeviceUnavailableError",
    "EngineError",
    "EngineStateError",
    "NonFiniteError",
    "UnknownStrategyError",
    "VersionError",
]
