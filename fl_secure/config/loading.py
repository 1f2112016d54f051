"""Reading a configuration: TOML tables and ``--set`` overrides into a checked :class:`Config`.

Every key is typed; an unknown key, a value of the wrong type, or a value outside the allowed
set stops with a :class:`~fl_secure.errors.ConfigError` that names the key and what is allowed.
``--set section.key=value`` overrides are parsed as TOML values.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from fl_secure.config.run import Config
from fl_secure.errors import ConfigError
from fl_secure.models.pretrained import is_builtin

# The one float key where TOML's ``inf`` means something (C-FINCH without a threshold is
# FINCH); every other float rejects inf and nan when the file is read, so a check such as
# ``lr > 0`` never has to think about them.
_INFINITY_ALLOWED = frozenset({"algorithm.cfinch_threshold"})

T = TypeVar("T")


def _convert(value: Any, hint: Any, key: str) -> Any:
    origin = get_origin(hint)
    if origin is Literal:
        allowed = get_args(hint)
        if value not in allowed:
            raise ConfigError(
                f"{key} = {value!r} is not allowed; allowed: {', '.join(map(repr, allowed))}"
            )
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} = {value!r}: expected a number")
        number = float(value)
        if math.isnan(number) or (math.isinf(number) and key not in _INFINITY_ALLOWED):
            raise ConfigError(f"{key} = {value!r}: expected a finite number")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r}: expected a string")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} = {value!r}: expected a list")
        item = get_args(hint)[0] if get_args(hint) else Any
        if item is Any:
            return tuple(value)
        return tuple(_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is types.UnionType:
        return value
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if not isinstance(value, dict):
            raise ConfigError(f"[{key}] must be a table")
        return _build(hint, value, key)
    raise ConfigError(f"{key}: unsupported type {hint}")  # pragma: no cover


def _build(cls: type[T], table: dict[str, Any], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - names)
    if unknown:
        where = f"[{prefix}]" if prefix else "the top level"
        raise ConfigError(
            f"unknown key {', '.join(unknown)} in {where}; allowed: {', '.join(sorted(names))}"
        )
    kwargs = {
        name: _convert(value, hints[name], f"{prefix}.{name}" if prefix else name)
        for name, value in table.items()
    }
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value`` (value in TOML syntax; bare words are strings)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    path, raw = text.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if not all(keys):
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return keys, value


def config_from_dict(
    table: dict[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
    *,
    override_base: Path | None = None,
) -> Config:
    """Build a validated :class:`Config` from a TOML table and ``--set`` overrides.

    ``override_base``: the folder relative file paths given with ``--set`` are taken from
    (the current directory, where the user typed them); ``None`` leaves them as given.
    """
    merged: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
    for text in overrides:
        keys, value = parse_override(text)
        if override_base is not None and tuple(keys) in PATH_KEYS and isinstance(value, str):
            value = _resolve(value, override_base)
        node = merged
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {key} is not a table")
        node[keys[-1]] = value
    return _build(Config, merged)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load and validate a TOML configuration file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        table = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p} is not a UTF-8 text file (TOML is UTF-8): {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from exc
    # Relative data and weight paths: from the config file's folder when written in the file,
    # from the current directory when given with --set.
    base = p.resolve().parent
    for section, key in PATH_KEYS:
        node = table.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str):
            node[key] = _resolve(node[key], base)
    return config_from_dict(table, overrides, override_base=Path.cwd())


PATH_KEYS = (
    ("data", "path"),
    ("data", "attributes_file"),
    ("data", "identities_file"),
    ("model", "pretrained"),
)


def _resolve(value: str, base: Path) -> str:
    if not value or Path(value).is_absolute() or is_builtin(value):  # "dlib-resnet": a name
        return value
    return str((base / value).resolve())
