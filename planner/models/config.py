"""Model configs: typed dataclasses with `key=value` overrides that name the field on error."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from planner.errors import InputError
from planner.limits import check_config


def _coerce(field: str, kind: Any, raw: Any) -> Any:
    """Convert a CLI string or JSON value to the field's declared type."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        kind = options[0]
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise InputError(field, f"{raw!r} is not a boolean", "true or false")
    if kind is int:
        if isinstance(raw, bool):
            raise InputError(field, f"{raw!r} is not an integer", "an integer")
        try:
            value = int(raw) if not isinstance(raw, float) or raw.is_integer() else None
        except (TypeError, ValueError, OverflowError):
            value = None
        if value is None:
            raise InputError(field, f"{raw!r} is not an integer", "an integer")
        return value
    if kind is float:
        if isinstance(raw, bool):
            raise InputError(field, f"{raw!r} is not a number", "a number")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise InputError(field, f"{raw!r} is not a number", "a number") from None
        if not math.isfinite(value):
            raise InputError(field, f"{raw!r} is not finite", "a finite number")
        return value
    if kind is str:
        if not isinstance(raw, str):
            raise InputError(field, f"{raw!r} is not a string", "a string")
        return raw
    return raw


def apply_overrides(config: Any, overrides: dict[str, Any], prefix: str = "config") -> Any:
    """Return a copy of dataclass `config` with `overrides` applied and validated."""
    hints = typing.get_type_hints(type(config))
    names = {f.name for f in dataclasses.fields(config)}
    changes = {}
    for key, raw in overrides.items():
        if key not in names:
            raise InputError(
                f"{prefix}.{key}", "unknown model parameter", "one of " + ", ".join(sorted(names))
            )
        changes[key] = _coerce(f"{prefix}.{key}", hints[key], raw)
    new = dataclasses.replace(config, **changes)
    check_config(new, prefix)
    validate = getattr(new, "validate", None)
    if validate is not None:
        validate(prefix)
    return new


def parse_key_values(items: list[str] | None, field: str = "--config") -> dict[str, str]:
    """Parse `["hidden=4096", "layers=32"]` into a dict."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(field, f"{item!r} is not key=value", "key=value, e.g. layers=32")
        out[key.strip()] = value.strip()
    return out


def require_positive(prefix: str, **values: int | float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise InputError(f"{prefix}.{name}", f"must be positive, got {value}", "> 0")


def require_divisible(prefix: str, name: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise InputError(
            f"{prefix}.{name}", f"{value} is not divisible by {by_name}={by}", "a multiple"
        )
