"""attrs validators that raise ``ConfigError`` naming the class and field (shared by all layers)."""

from __future__ import annotations

from typing import Any

import attrs

from heads.errors import ConfigError


def of_type(kind: type | tuple[type, ...]) -> Any:
    """The value is an instance of ``kind`` (a bool is no int or float here)."""
    names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(
                f"{type(instance).__name__}.{attribute.name} must be {names}; "
                f"got {value!r} ({type(value).__name__})"
            )

    return check


def positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be > 0, got {value!r}")


def non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be >= 0, got {value!r}")


def one_of(*allowed: object) -> Any:
    """The value is one of ``allowed``; the error lists them."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in allowed:
            raise ConfigError(
                f"{type(instance).__name__}.{attribute.name} must be one of "
                f"{', '.join(map(repr, allowed))}; got {value!r}"
            )

    return check


def int_field(default: int, check: Any = positive) -> Any:
    return attrs.field(default=default, validator=[of_type(int), check])


def float_field(default: float, check: Any = non_negative) -> Any:
    return attrs.field(default=default, validator=[of_type((int, float)), check])


def bool_field(default: bool) -> Any:
    return attrs.field(default=default, validator=of_type(bool))
