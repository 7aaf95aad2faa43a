"""The project's exception hierarchy (public home: ``engine.errors``).

It lives in the bottom package so that every layer (engine -> strategies -> heads) can raise it
without importing upwards; so does :func:`did_you_mean`, the hint their messages share.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class EngineError(Exception):
    """Root of every error composable-engine raises on purpose."""


class UnknownStrategyError(EngineError, KeyError):
    """A head, backend or device name that no registry knows."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DeviceUnavailableError(EngineError, RuntimeError):
    """The requested device platform's runtime is missing on this machine."""


class ConfigError(EngineError, ValueError):
    """A configuration value is invalid, or parts cannot run together with it."""


class BatchError(EngineError, ValueError):
    """A batch lacks a required field or has a wrong dtype or shape."""


class EngineStateError(EngineError, RuntimeError):
    """A call made in the wrong lifecycle state (before initialize, train on forward-only...)."""


class NonFiniteError(EngineError, ArithmeticError):
    """A non-finite loss, gradient norm or learning rate stopped training (by the configured
    policy); the weights, optimizer state and LR schedule are those of the last applied step."""


class CheckpointError(EngineError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or belongs to another model."""


class VersionError(EngineError, ImportError):
    """An installed dependency is outside the range this project is tested with."""


def did_you_mean(unknown: Iterable[str], known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known names closest to the unknown ones, or ``""``."""
    known = list(known)
    close = [
        f"{wrong!r} -> {match[0]!r}"
        for wrong in sorted(unknown)
        if (match := difflib.get_close_matches(wrong, known, n=1, cutoff=0.6))
    ]
    if not close:
        return ""
    if len(close) == 1:
        return f" (did you mean {close[0].split(' -> ')[1]}?)"
    return f" (did you mean {', '.join(close)}?)"
