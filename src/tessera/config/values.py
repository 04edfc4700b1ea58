"""A config value as its key's schema type: `coerce` (type, choices, bounds) and the conversions it uses,
from a YAML value or a command-line string alike. `tessera.config.loader` reads every layer through it."""

from __future__ import annotations

import dataclasses
import decimal
import json
import math
from typing import Any

import yaml

from tessera.config.schema import ConfigError

INT_RANGE = (-2**63, 2**63 - 1)  # int64: what an integer key may hold (JAX and NumPy take no wider integer)


def unquoted(value: str) -> str:
    """A command-line value written in quotes that reached us (an argument list, a job spec), read as
    YAML and MaxText's command line read it: `metrics_file=""` is empty and `run_name='x'` is x; they
    were kept, quotes and all (metrics went to a file named "" in the working directory)."""
    if len(value) < 2 or value[0] != value[-1] or value[0] not in "'\"":
        return value
    try:
        text = yaml.safe_load(value)
    except yaml.YAMLError:  # "a" "b": not one quoted value
        return value
    return text if isinstance(text, str) else value


def coerce(name: str, raw: Any, f: dataclasses.Field) -> Any:
    """Convert `raw` (YAML value or command-line string) to the field's declared type."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    value = _convert(name, raw, kind, f)
    choices, minimum = f.metadata["choices"], f.metadata["minimum"]
    if choices and value not in choices:
        raise ConfigError(f"{name}={raw!r} is not allowed; choose one of: {', '.join(repr(c) for c in choices)}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} is too small; it must be >= {minimum}")
    if f.metadata.get("maximum") is not None and value > f.metadata["maximum"]:
        raise ConfigError(f"{name}={raw!r} is too large; it must be <= {f.metadata['maximum']}")
    return value


def parse_bool(name: str, raw: Any) -> bool:
    """A bool key's value as written (true, "True", 1, yes, on, and their opposites); ConfigError otherwise."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a valid bool; use true or false")


def _no_nul(name: str, raw: Any, text: str) -> str:
    """`text`, unless it holds a NUL character, which no file name, name or flag can hold (a YAML file's
    `run_name: "a\\0b"` stopped train.py with a ValueError traceback, "embedded null byte", in Orbax)."""
    if "\0" in text:
        raise ConfigError(f"{name}={raw!r} contains a NUL character (\\0), which no path, name or flag can hold; "
                          "remove it")
    return text


def _example(f: dataclasses.Field) -> str:
    """A list key's default as a command-line value, for its errors' example (its own default: train_data_columns
    was shown mlp_activations' ["silu","linear"])."""
    return json.dumps(f.default_factory(), separators=(",", ":"))


def _convert(name: str, raw: Any, kind: str, f: dataclasses.Field) -> Any:
    bad = ConfigError(f"{name}={raw!r} is not a valid {kind}")
    if kind == "str":
        if isinstance(raw, (dict, list)):
            raise bad
        return _no_nul(name, raw, "" if raw is None else str(raw))
    if kind == "bool":
        return parse_bool(name, raw)
    if kind == "int":  # exact (decimal, never float): 1e3 is 1000, 99999999999999999999999 is refused
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise bad
        try:
            number = decimal.Decimal(raw)
        except decimal.InvalidOperation:
            raise bad from None
        if not number.is_finite() or number != number.to_integral_value():
            raise ConfigError(f"{name}={raw!r} must be a whole number")
        if not INT_RANGE[0] <= number <= INT_RANGE[1]:
            raise ConfigError(f"{name}={raw!r} is out of range; an integer key takes whole numbers from "
                              f"{INT_RANGE[0]} to {INT_RANGE[1]}")
        return int(number)
    if kind == "float":
        if isinstance(raw, bool):
            raise bad
        try:
            number = float(raw)
        except OverflowError:  # an integer beyond 1.8e308
            number = math.inf
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(number):
            raise ConfigError(f"{name}={raw!r} must be a finite number (not nan or inf)")
        return number
    if kind == "list":
        value = raw
        if isinstance(raw, str) and raw.strip().startswith("["):
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ConfigError(f"{name}={raw!r} is not a valid list ({getattr(e, 'problem', None) or 'bad YAML'}); "
                                  f"write it as {name}=[\"a\",\"b\"] or {name}=a,b") from None
        elif isinstance(raw, str):
            value = [s for s in raw.split(",") if s]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}={raw!r} must be a list of strings, e.g. {name}={_example(f)}")
        return [_no_nul(name, raw, v.strip()) for v in value]
    raise TypeError(f"schema field {name} has unsupported type {kind}")
