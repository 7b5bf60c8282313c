"""Typed settings: frozen dataclasses built from plain data (a parsed YAML file), every error naming
its dotted key.

A settings class is a frozen dataclass whose `__post_init__` checks its values with `require`;
`build` makes one from a mapping, refusing unknown keys, wrong types and impossible values with a
ConfigError such as "ppo.clip_coef: 0 is invalid: must be > 0". The experiment's sections
(services/common/config/ for the roles, services/algorithms/<name>/config.py for each algorithm)
and the experiment itself (services/config.py) are all built this way.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

S = TypeVar("S", bound="DataclassInstance")


class ConfigError(ValueError):
    """An invalid experiment config; the message starts with the dotted key at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def require(cond: bool, key: str, value: Any, why: str) -> None:
    """ConfigError "key: value is invalid: why" unless `cond` (`key` relative to the section)."""
    if not cond:
        raise ConfigError(key, f"{value!r} is invalid: {why}")


_YAML11_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")


def convert(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` (strictly: no bool for int, no str for float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return convert(inner[0], value, key)
        for tp_ in inner:   # several types (e.g. int | float | str): the first that takes the value
            try:
                return convert(tp_, value, key)
            except ConfigError:
                continue
        names = " or ".join(getattr(a, "__name__", str(a)) for a in inner)
        raise ConfigError(key, f"must be {names}, got {type(value).__name__} {value!r}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if value is None:  # `section:` with nothing under it means "all defaults"
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a mapping of settings, got {type(value).__name__}")
        return build(tp, value, key + ".")
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a mapping, got {type(value).__name__} {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {convert(key_type, k, key): convert(value_type, v, f"{key}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"must be a list, got {type(value).__name__} {value!r}")
        (item, _) = typing.get_args(tp)
        return tuple(convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
        return float(value)  # PyYAML (YAML 1.1) reads `1e-3` as a string; users mean the number
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise ConfigError(key, f"must be {getattr(tp, '__name__', tp)}, got {type(value).__name__} {value!r}")


def build(cls: type[S], data: Mapping[str, Any], prefix: str = "", **given: Any) -> S:
    """`cls` (a settings dataclass) from the mapping `data`, its keys named under `prefix` in errors.
    `given` are constructor arguments already built (not looked up in `data`)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init} - set(given)
    replaced = getattr(cls, "_replaced", {})
    for k in data:
        if k in replaced:
            raise ConfigError(f"{prefix}{k}", f"no longer a key: {replaced[k]}")
        if k not in names:
            raise ConfigError(f"{prefix}{k}", f"unknown key (known keys here: {', '.join(sorted(names))})")
    kwargs = {k: convert(hints[k], v, f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs, **given)
    except ConfigError as e:
        if e.key.startswith(prefix) and prefix:
            raise
        raise ConfigError(f"{prefix}{e.key}", str(e).split(": ", 1)[1]) from None


def plain(value: Any) -> Any:
    """Settings as plain data (dicts, lists, scalars) for YAML: the inverse of `build`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, typing.Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return value

