"""How request bodies are held to the OpenAPI schema the service publishes: strict types (no
"8" for 8, no true for 1) where a whole-valued number still counts as an integer, no NaN, no
unknown keys, a null refused where the schema's one-of rules speak of keys, a zoo name and its
family's typed config keys in the schema, and a cluster profile checked against its JSON
schema after pydantic (which reads YAML profiles laxly) has named any field at fault."""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, WrapValidator, model_validator

from planner.cluster.profile import ClusterProfile


def _whole_number(value: Any) -> Any:
    """484.0 is the integer 484, as JSON Schema's "integer" says; true stays refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _takes_int(annotation: Any) -> tuple[bool, bool]:
    """(an int field, a list of ints) for a field annotation; floats excluded."""
    args = typing.get_args(annotation) or (annotation,)
    flat = [typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a for a in args]
    if float in flat:
        return False, False
    lists = [typing.get_args(a) for a in flat if typing.get_origin(a) is list]
    in_list = any(_takes_int(a[0])[0] for a in lists if a)
    return int in flat, in_list


def strict(schema_extra: Any = None) -> ConfigDict:
    """Request bodies: no unknown keys; strict types (JSON `true` is not the integer 1, "8" is
    not 8); no NaN or Infinity; `schema_extra` adds to the OpenAPI schema."""
    return ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra=schema_extra
    )


@functools.cache
def _int_fields(model: type[BaseModel]) -> tuple[frozenset[str], frozenset[str]]:
    """(integer fields, integer-list fields) of a request model, read once per class."""
    kinds = {name: _takes_int(f.annotation) for name, f in model.model_fields.items()}
    return (
        frozenset(n for n, (scalar, _) in kinds.items() if scalar),
        frozenset(n for n, (_, in_list) in kinds.items() if in_list),
    )


class Strict(BaseModel):
    model_config = strict()

    @model_validator(mode="before")
    @classmethod
    def _whole_numbers(cls, data: Any) -> Any:
        """Integer fields take whole-valued numbers (strict mode alone refuses 484.0)."""
        if not isinstance(data, dict):
            return data
        scalars, lists = _int_fields(cls)
        out = dict(data)
        for name in scalars & out.keys():
            out[name] = _whole_number(out[name])
        for name in lists & out.keys():
            if isinstance(out[name], list):
                out[name] = [_whole_number(v) for v in out[name]]
        return out


def not_null(schema: dict[str, Any]) -> None:
    """Drop `null` from optional properties' schemas: an absent key is what means "not
    given", and the one-of rules below speak of keys being present."""
    for prop in schema.get("properties", {}).values():
        options = prop.get("anyOf")
        if options and {"type": "null"} in options:
            rest = [o for o in options if o != {"type": "null"}]
            prop.pop("anyOf")
            prop.pop("default", None)
            prop.update(rest[0] if len(rest) == 1 else {"anyOf": rest})


def model_schema(schema: dict[str, Any]) -> None:
    """One of three sources; a zoo name alone is one of the zoo's names, with the config
    overrides its family takes (planner.models.config.override_schema)."""
    from planner.models.registry import zoo_override_schemas

    not_null(schema)

    def only(key: str, *without: str) -> dict[str, Any]:
        rule: dict[str, Any] = {"required": [key]}
        if without:
            rule["not"] = {"anyOf": [{"required": [w]} for w in without]}
        return rule

    zoo = only("name", "graph", "hf_config")
    zoo["anyOf"] = [
        {"properties": {"name": {"enum": names}, "config": config}}
        for names, config in zoo_override_schemas()
    ]
    hf = only("hf_config", "graph")
    hf["properties"] = {
        "hf_config": {"anyOf": [{"required": ["model_type"]}, {"required": ["architectures"]}]}
    }
    schema["oneOf"] = [only("graph", "name", "hf_config", "config"), hf, zoo]


def no_nulls(data: Any) -> Any:
    """A key given as null is refused (leave it out): the one-of rules speak of keys."""
    if isinstance(data, dict):
        nulls = [k for k, v in data.items() if v is None]
        if nulls:
            raise ValueError(f"{nulls[0]} is null: leave the key out instead")
    return data


def cluster_schema(schema: dict[str, Any]) -> None:
    not_null(schema)
    schema["oneOf"] = [
        {"required": ["name"], "not": {"required": ["profile"]}},
        {"required": ["profile"], "not": {"required": ["name"]}},
    ]


@functools.cache
def _profile_validator() -> Any:
    import jsonschema_rs

    schema = TypeAdapter(ClusterProfile).json_schema(mode="validation")
    return jsonschema_rs.Draft202012Validator(schema)


def _as_schema_says(value: Any, handler: Any) -> Any:
    """A profile in a request is held to its JSON schema: after pydantic's own validation
    (which names the field of any error), the JSON it came from is checked against the
    schema, since pydantic's lax mode (profiles are also read from YAML) takes "8" for 8,
    which the schema refuses. The schema in turn takes 8.0 for the integer 8."""
    profile = handler(value)
    if isinstance(value, dict):
        error = next(iter(_profile_validator().iter_errors(value)), None)
        if error is not None:
            where = ".".join(str(p) for p in error.instance_path) or "profile"
            raise ValueError(f"{where}: {error.message[:300]}")
    return profile


ProfileInput = Annotated[ClusterProfile, WrapValidator(_as_schema_says)]
