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


def _field_kind(hint: Any) -> tuple[Any, bool]:
    """(the declared type, whether None is allowed) of a config field's type hint."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return options[0], True
    return hint, False


def check_json_types(config: Any, overrides: dict[str, Any], prefix: str = "config") -> None:
    """JSON overrides (the service's) typed as the fields are: an integer for an int field
    (12.0 is 12), a number for a float, true/false for a bool; null where the field may be
    unset. The CLI's key=value strings go through _coerce instead."""
    hints = typing.get_type_hints(type(config))
    for key, raw in overrides.items():
        if key not in hints:
            continue  # apply_overrides names the unknown key
        kind, optional = _field_kind(hints[key])
        if raw is None and optional:
            continue
        ok = {
            bool: isinstance(raw, bool),
            int: not isinstance(raw, bool)
            and (isinstance(raw, int) or (isinstance(raw, float) and raw.is_integer())),
            float: not isinstance(raw, bool) and isinstance(raw, int | float),
            str: isinstance(raw, str),
        }.get(kind, True)
        if not ok:
            expected = {bool: "true or false", int: "an integer", float: "a number"}
            raise InputError(f"{prefix}.{key}", f"{raw!r}", expected.get(kind, str(kind)))


def override_schema(config: Any) -> dict[str, Any]:
    """The JSON schema of the overrides `config`'s family accepts: its field names, each
    typed, within check_config's bounds and the family's own `choices`; a field's lower
    bound is found by asking validate() itself (0 refused: positive), so the schema states
    the rules the service applies, not a copy of them."""
    from planner.limits import CONFIG_INT_LIMITS, MAX_CONFIG_FLOAT, MAX_CONFIG_INT

    hints = typing.get_type_hints(type(config))
    choices = getattr(type(config), "choices", {})

    def accepts(name: str, value: Any) -> bool:
        try:
            apply_overrides(config, {name: value})
        except InputError:
            return False
        return True

    properties: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        kind, optional = _field_kind(hints[f.name])
        if f.name in choices:
            schema: dict[str, Any] = {"type": "integer", "enum": list(choices[f.name])}
        elif kind is bool:
            schema = {"type": "boolean"}
        elif kind is int:
            high = CONFIG_INT_LIMITS.get(f.name, MAX_CONFIG_INT)
            schema = {"type": "integer", "minimum": 0 if accepts(f.name, 0) else 1}
            schema["maximum"] = high
        elif kind is float:
            schema = {"type": "number", "maximum": MAX_CONFIG_FLOAT}
            if not accepts(f.name, 0.0):
                schema["exclusiveMinimum"] = 0
            else:
                schema["minimum"] = -MAX_CONFIG_FLOAT if accepts(f.name, -1.0) else 0
        else:
            schema = {"type": "string", "maxLength": 1000}
        properties[f.name] = {"anyOf": [schema, {"type": "null"}]} if optional else schema
    return {"type": "object", "properties": properties, "additionalProperties": False}


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
