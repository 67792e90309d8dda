"""Typed YAML configs: dataclasses built from plain mappings, with errors that name the field.

`build(cls, data)` checks every value against the dataclass's type hints (str, int, float,
bool, Optional, list[T], tuple[...], dict[str, T], nested dataclasses) and refuses unknown keys, so a
typo in a YAML file is an error such as `retained.kl_contexts: expected an integer, got 'many'`
rather than a silently ignored field. A number must be finite (`nan`, `.inf`, 'inf' are refused:
`train.lr: expected a finite number, got nan`) and an integer must fit in 64 bits (every count and
seed reaches torch, numpy or the ledger as one). A field whose type depends on the others (a
training method's options, atlas_core.train.config) gets it from the dataclass's classmethod
`field_types(data) -> {name: type}`, asked before the fields are checked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path

import yaml

from .errors import InputError


class ConfigError(InputError):
    """A configuration value is missing, unknown or of the wrong type; the message names the field."""


__all__ = ["ConfigError", "build", "field", "help_of", "load_yaml"]

_INT64 = 2**63


def _shape(hint) -> str:
    """What a YAML value of this type looks like: 'mapping', 'list' or 'scalar'."""
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict:
        return "mapping"
    return "list" if typing.get_origin(hint) in (list, tuple) else "scalar"


def _value_shape(value) -> str:
    return "mapping" if isinstance(value, dict) else "list" if isinstance(value, (list, tuple)) else "scalar"


def _convert(value, hint, where: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{where}: expected a value, got null")
        options = [a for a in args if a is not type(None)]
        fitting = [a for a in options if _shape(a) == _value_shape(value)]
        if len(fitting) == 1 and _shape(fitting[0]) != "scalar":  # a mapping or a list: its own errors name its fields
            return _convert(value, fitting[0], where)
        errors = []
        for option in options:
            try:
                return _convert(value, option, where)
            except ConfigError as e:
                errors.append(str(e).split(": ", 1)[1])
        raise ConfigError(f"{where}: {' or '.join(errors)}")
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} items, got {value!r}")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_convert(k, args[0], f"{where} key"): _convert(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if not -_INT64 <= value < _INT64:
            raise ConfigError(f"{where}: expected an integer of at most 64 bits, got {value!r}")
        return value
    if hint is float:
        number = value
        if isinstance(value, str):  # YAML 1.1 reads 2e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            number = float(number)
        except OverflowError:  # an integer beyond any float
            number = math.inf
        if not math.isfinite(number):  # YAML .nan / .inf, the strings 'nan' / 'inf', 1e999
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported field type {hint!r}")


def build(cls, data, where: str = ""):
    """Dataclass `cls` from a mapping; every error names the dotted path of the field."""
    prefix = f"{where}." if where else ""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping of fields, got {data!r}")
    hints = _hints(cls)
    if hasattr(cls, "field_types"):
        hints = hints | cls.field_types(data)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        expected = f"expected one of {names}" if names else "this block takes no fields"
        raise ConfigError(f"{prefix}{unknown[0]}: unknown field; {expected}")
    values = {k: _convert(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**values)
    except ConfigError as e:  # from __post_init__, which names fields relative to its own class
        raise ConfigError(f"{prefix}{e}") from e


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)  # evaluated once per class (postponed annotations are strings)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    return {} if data is None else data


def help_of(cls) -> dict[str, str]:
    """field name -> its documented meaning (for --help and docs)."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def field(text: str, default=dataclasses.MISSING, factory=dataclasses.MISSING):
    """A dataclass field with a help text (every config field is documented where it is defined)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"help": text})
    return dataclasses.field(default=default, metadata={"help": text})
