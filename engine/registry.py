"""Name -> part registries for heads, backends and device platforms.

Plain dicts behind ``register`` and ``get``. Built-ins are registered as import paths and
imported on first use (``import engine`` must not import megatron-core); plugins arrive through
the entry-point groups ``composable_engine.heads`` / ``.backends`` / ``.devices``, are listed
without being imported, and a broken plugin fails only when it is asked for, saying why.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

import attrs
import cattrs
from cattrs.v import format_exception

from heads.errors import (
    ConfigError,
    DeviceUnavailableError,
    EngineError,
    UnknownStrategyError,
    did_you_mean,
)
from strategies.devices.base import DevicePlatform

T = TypeVar("T")


class PluginLoadError(EngineError, ImportError):
    """A registered part could not be imported."""


class Registry(Generic[T]):
    """Names of one kind of part ("head", "backend", "device") and the factories behind them."""

    def __init__(
        self,
        kind: str,
        group: str,
        builtins: Mapping[str, str],
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self.group = group
        #: Other names people use for a part (lower case) -> the name to suggest instead.
        self.aliases = dict(aliases or {})
        self._factories: dict[str, Callable[..., T]] = {}
        self._lazy: dict[str, Callable[[], Callable[..., T]]] = {
            name: _import_path_loader(path) for name, path in builtins.items()
        }
        self._sources: dict[str, str] = {
            name: f"built-in ({path})" for name, path in builtins.items()
        }
        self._plugins_scanned = False

    # -- registration --------------------------------------------------------------------------
    def register(
        self, name: str, factory: Callable[..., T] | None = None, *, override: bool = False
    ) -> Any:
        """Register ``factory`` under ``name``; usable as a decorator: ``@register("reward")``."""

        def add(factory: Callable[..., T]) -> Callable[..., T]:
            self._scan_plugins()
            if not override and (name in self._factories or name in self._lazy):
                raise ConfigError(
                    f"a {self.kind} named {name!r} is already registered "
                    f"({self._sources.get(name, 'by user code')}); pass override=True to replace it"
                )
            self._lazy.pop(name, None)
            self._factories[name] = factory
            self._sources[name] = f"registered by {getattr(factory, '__module__', '?')}"
            return factory

        return add if factory is None else add(factory)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (tests, and plugins replacing a part at run time)."""
        self._factories.pop(name, None)
        self._lazy.pop(name, None)
        self._sources.pop(name, None)

    # -- lookup --------------------------------------------------------------------------------
    def names(self) -> list[str]:
        self._scan_plugins()
        return sorted({*self._factories, *self._lazy})

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered as ``name``; unknown names are answered with the known ones."""
        self._scan_plugins()
        if name in self._factories:
            return self._factories[name]
        if name in self._lazy:
            try:
                factory = self._lazy[name]()
            except Exception as error:
                raise PluginLoadError(
                    f"{self.kind} {name!r} ({self._sources[name]}) failed to import: "
                    f"{type(error).__name__}: {error}"
                ) from error
            self._factories[name] = factory
            del self._lazy[name]
            return factory
        raise UnknownStrategyError(self._unknown_message(name))

    def create(self, name: str, options: Mapping[str, Any] | None = None) -> T:
        """Build the part ``name`` from ``options`` (attrs parts are structured by cattrs)."""
        factory = self.get(name)
        return build_part(factory, options or {}, f"{self.kind} {name!r}")

    def _unknown_message(self, name: str) -> str:
        known = self.names()
        by_lower = {**self.aliases, **{known_name.lower(): known_name for known_name in known}}
        close = difflib.get_close_matches(name.lower(), by_lower, n=1)
        hint = f"; did you mean {by_lower[close[0]]!r}?" if close else "."
        return f"unknown {self.kind} {name!r}{hint} Known {self.kind}s: {', '.join(known)}"

    def _scan_plugins(self) -> None:
        if self._plugins_scanned:
            return
        self._plugins_scanned = True
        for entry in entry_points(group=self.group):
            if entry.name in self._factories or entry.name in self._lazy:
                continue  # built-ins and explicit registrations win over plugins of the same name
            self._lazy[entry.name] = _entry_point_loader(entry)
            self._sources[entry.name] = f"plugin {entry.value} (entry point {self.group})"


def build_part(factory: Callable[..., T], options: Mapping[str, Any], what: str) -> T:
    """Call ``factory`` with ``options``; attrs classes are structured (unknown keys rejected)."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"options for {what} must be a mapping, got {type(options).__name__}")
    if isinstance(factory, type) and hasattr(factory, "__attrs_attrs__"):
        try:
            part: T = STRICT_CONVERTER.structure(dict(options), factory)
        except Exception as error:
            raise ConfigError(
                f"invalid options for {what}: {describe_structure_error(error)}"
            ) from error
        return part
    try:
        return factory(**options)
    except TypeError as error:
        raise ConfigError(f"invalid options for {what}: {error}") from error


def describe_structure_error(error: BaseException) -> str:
    """One line per leaf problem of a cattrs error, each naming its class and field."""
    if isinstance(error, cattrs.BaseValidationError):
        return "; ".join(_problems(error, ""))
    if isinstance(error, EngineError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _problems(error: BaseException, owner: str) -> Iterator[str]:
    """The leaf problems under ``error``; ``owner`` names where it sits (``Class.field``)."""
    if isinstance(error, cattrs.ClassValidationError):
        with_notes, without = error.group_exceptions()
        for inner, note in with_notes:
            yield from _problems(inner, f"{error.cl.__name__}.{note.name}")
        for inner in without:
            yield from _problems(inner, error.cl.__name__)
    elif isinstance(error, cattrs.IterableValidationError):
        for inner in error.exceptions:
            yield from _problems(inner, owner)
    elif isinstance(error, EngineError):
        yield str(error)
    elif isinstance(error, cattrs.ForbiddenExtraKeysError) and attrs.has(error.cl):
        names = [field.name for field in attrs.fields(error.cl) if field.init]
        extra = ", ".join(sorted(error.extra_fields))
        yield (
            f"{error.cl.__name__} has no field(s) {extra}"
            f"{did_you_mean(error.extra_fields, names)}; its fields: {', '.join(names)}"
        )
    elif isinstance(error, _NotExactly):
        yield " ".join(filter(None, (owner, str(error))))
    else:
        yield ": ".join(filter(None, (owner, format_exception(error, None))))


class _NotExactly(TypeError):
    """A scalar of another type than its field's (raised while structuring)."""


def _exactly(kind: type) -> Callable[[Any, Any], Any]:
    """A structure hook taking a ``kind`` value as it is: cattrs' own would make 2.5 the int 2
    and "false" the bool True. A float field also takes an int."""
    accepted: tuple[type, ...] = (int, float) if kind is float else (kind,)

    def structure(value: Any, _: Any) -> Any:
        if isinstance(value, accepted) and (kind is bool or not isinstance(value, bool)):
            return value
        raise _NotExactly(f"must be {kind.__name__}; got {value!r} ({type(value).__name__})")

    return structure


#: Structures attrs configs from dicts; unknown keys are errors rather than silently dropped,
#: and scalars are taken as they are, never cast.
STRICT_CONVERTER = cattrs.Converter(forbid_extra_keys=True)
for _scalar in (int, float, bool, str):
    STRICT_CONVERTER.register_structure_hook(_scalar, _exactly(_scalar))


def _import_path_loader(path: str) -> Callable[[], Callable[..., Any]]:
    module_name, _, attribute = path.partition(":")

    def load() -> Callable[..., Any]:
        return getattr(importlib.import_module(module_name), attribute)

    return load


def _entry_point_loader(entry: EntryPoint) -> Callable[[], Callable[..., Any]]:
    def load() -> Callable[..., Any]:
        return entry.load()

    return load


HEADS: Registry[Any] = Registry(
    "head",
    "composable_engine.heads",
    {
        "lm": "heads.lm:LMHead",
        "value": "heads.value:ValueHead",
        "reward": "heads.reward:RewardHead",
    },
)
BACKENDS: Registry[Any] = Registry(
    "backend",
    "composable_engine.backends",
    {
        "megatron": "strategies.backends.megatron.backend:MegatronBackend",
        "fsdp2": "strategies.backends.fsdp2.backend:Fsdp2Backend",
    },
)
DEVICES: Registry[Any] = Registry(
    "device",
    "composable_engine.devices",
    {
        "cpu": "strategies.devices.cpu:CpuPlatform",
        "cuda": "strategies.devices.cuda:CudaPlatform",
        "npu": "strategies.devices.npu:NpuPlatform",
    },
    aliases={"gpu": "cuda", "nvidia": "cuda", "ascend": "npu", "auto": "auto"},
)

#: ``device="auto"`` tries these in order and takes the first available.
AUTO_DEVICE_ORDER = ("cuda", "npu", "cpu")


def register_head(name: str, *, override: bool = False) -> Any:
    """Decorator registering a Head class or factory under ``name``."""
    return HEADS.register(name, override=override)


def register_backend(name: str, *, override: bool = False) -> Any:
    """Decorator registering a Backend class or factory under ``name``."""
    return BACKENDS.register(name, override=override)


def register_device(name: str, *, override: bool = False) -> Any:
    """Decorator registering a DevicePlatform class or factory under ``name``."""
    return DEVICES.register(name, override=override)


def resolve_device(device: str | DevicePlatform, options: Mapping[str, Any]) -> DevicePlatform:
    """A platform object from a name (``auto``: the first available of cuda, npu, cpu).

    Under ``auto`` each candidate is built with the ``options`` it takes; options the chosen
    platform does not take are refused, naming the platforms that do take them (dropped
    silently, an NPU-only option would change nothing on the GPU a run landed on)."""
    if not isinstance(device, str):
        return device
    if device != "auto":
        platform: DevicePlatform = DEVICES.create(device, options)
        return platform
    reasons = []
    for name in AUTO_DEVICE_ORDER:
        taken = _options_taken(DEVICES.get(name), options)
        candidate: DevicePlatform = DEVICES.create(name, {key: options[key] for key in taken})
        state = candidate.availability()
        if not state.ok:
            reasons.append(state.reason)
            continue
        if foreign := [key for key in options if key not in taken]:
            takers = [
                other
                for other in AUTO_DEVICE_ORDER
                if set(foreign) & _options_taken(DEVICES.get(other), options)
            ]
            raise ConfigError(
                f"device='auto' chose {name}, which takes no option {', '.join(foreign)} "
                f"({' or '.join(takers) or 'no platform'} does); name the device or drop them"
            )
        return candidate
    raise DeviceUnavailableError("device='auto' found no usable platform: " + "; ".join(reasons))


def _options_taken(factory: Callable[..., Any], options: Mapping[str, Any]) -> set[str]:
    """Which of ``options`` a part factory takes: an attrs class's init fields; any other
    factory is given them all (it refuses what it does not take)."""
    if isinstance(factory, type) and hasattr(factory, "__attrs_attrs__"):
        fields = {field.name for field in attrs.fields(factory) if field.init}
        return {key for key in options if key in fields}
    return set(options)


def check_part(part: Any, protocol: type, role: str, known: list[str]) -> Any:
    """``part`` itself if it is an instance of ``protocol``; a ConfigError saying what to pass."""
    if isinstance(part, type):
        raise ConfigError(
            f"{role} must be an instance, not the class {part.__name__}; pass {part.__name__}()"
        )
    if not isinstance(part, protocol):
        raise ConfigError(
            f"{role} must be a name ({', '.join(known)}) or a {protocol.__name__} object; got "
            f"{type(part).__name__}: {part!r}"
        )
    return part
