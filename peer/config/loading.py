"""Loading configuration: TOML files into the dataclasses (peer.config.run, peer.config.settings), with
`--set FIELD=VALUE` overrides; every mistake a ConfigError naming the field."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from dht.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value that cannot be used; the message starts with the field's dotted name."""


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, not a TOML file") from None
    except PermissionError:
        raise ConfigError(f"{path}: cannot be read by this user") from None


def port_range(text: str) -> list[int]:
    """The ports of "FIRST-LAST" (or one port), in order; [] for an empty text. ConfigError names relay.ports."""
    if not text.strip():
        return []
    first, _, last = text.strip().partition("-")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"relay.ports: expected FIRST-LAST like 41000-41007, got {text!r}") from None
    if not 1 <= low <= high <= 65535:
        raise ConfigError(f"relay.ports: expected 1 <= FIRST <= LAST <= 65535, got {text!r}")
    return list(range(low, high + 1))


def require_positive(name: str, value: Any) -> None:
    if not value > 0:
        raise ConfigError(f"{name}: must be positive, got {value}")


def from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass `cls` from nested dicts, checking names and types; ConfigError names the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'spec'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown field (known: {', '.join(sorted(names))})")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            values[f.name] = _convert(hints[f.name], data[f.name], prefix + f.name)
    return cls(**values)


def _convert(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, name + ".")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(options[0], value, name)
    if hint is dict or origin is dict:  # free-form data (a model directory's config.json), kept as read
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a table, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_convert(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{name}: unsupported field type {hint}")


def apply_override(obj: Any, item: str) -> None:
    """Apply one `FIELD=VALUE` override (VALUE in TOML syntax, else taken as a string) to a config dataclass."""
    field_name, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"--set {item!r}: expected FIELD=VALUE")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    set_path(obj, field_name.strip(), value)


def set_path(obj: Any, dotted: str, value: Any) -> None:
    """Override one field (e.g. 'network.port') of a config dataclass with a flag's value, type-checked."""
    *parents, last = dotted.split(".")
    target = obj
    for i, part in enumerate(parents):
        if not dataclasses.is_dataclass(target) or part not in {f.name for f in dataclasses.fields(target)}:
            raise ConfigError(f"{'.'.join(parents[: i + 1])}: unknown section")
        target = getattr(target, part)
    hints = typing.get_type_hints(type(target))
    if last not in hints:
        raise ConfigError(f"{dotted}: unknown field")
    setattr(target, last, _convert(hints[last], value, dotted))
