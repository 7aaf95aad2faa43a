"""attrs validators that raise ``ConfigError`` naming the class and field (shared by all layers)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from heads.errors import ConfigError

#: Largest seed a config takes: torch, NumPy (< 2**32) and megatron's per-rank seeds (the seed
#: plus a few thousand) all accept every seed up to it.
MAX_SEED = 2**31 - 1


def _name(instance: object, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def of_type(kind: type | tuple[type, ...]) -> Any:
    """The value is an instance of ``kind`` (a bool is no int or float here)."""
    names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(
                f"{_name(instance, attribute)} must be {names}; "
                f"got {value!r} ({type(value).__name__})"
            )

    return check


def finite(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{_name(instance, attribute)} must be a finite number, got {value!r}")


def positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{_name(instance, attribute)} must be > 0, got {value!r}")


def non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{_name(instance, attribute)} must be >= 0, got {value!r}")


def in_range(low: float, high: float) -> Any:
    """``low <= value <= high``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if not low <= value <= high:
            raise ConfigError(
                f"{_name(instance, attribute)} must be in [{low}, {high}], got {value!r}"
            )

    return check


def one_of(*allowed: object) -> Any:
    """The value is one of ``allowed``; the error lists them."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in allowed:
            raise ConfigError(
                f"{_name(instance, attribute)} must be one of "
                f"{', '.join(map(repr, allowed))}; got {value!r}"
            )

    return check


def int_field(default: int, check: Any = positive) -> Any:
    return attrs.field(default=default, validator=[of_type(int), check])


def optional_int_field(check: Any = positive) -> Any:
    """An int that may be None (its default)."""
    return attrs.field(default=None, validator=attrs.validators.optional([of_type(int), check]))


def float_field(default: float, check: Any = non_negative) -> Any:
    """A finite int or float."""
    return attrs.field(default=default, validator=[of_type((int, float)), finite, check])


def bool_field(default: bool) -> Any:
    return attrs.field(default=default, validator=of_type(bool))


def seed_field(default: int) -> Any:
    """A random seed in ``[0, MAX_SEED]``."""
    return int_field(default, in_range(0, MAX_SEED))
