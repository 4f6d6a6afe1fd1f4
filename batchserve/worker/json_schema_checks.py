"""A JSON Schema checked before xgrammar compiles it: nesting within bounds, and only keywords its converter
implements (it ignores the others, so an output that ignored part of its schema would not validate). No torch or
xgrammar here: a front end runs these checks on every structured request without loading either."""

from __future__ import annotations

import json
from typing import Any

from batchserve.sampling_params import InvalidRequestError

# Keywords the converter implements (others would be dropped silently: refused instead). Annotations are harmless.
SCHEMA_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
        "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "pattern", "minLength", "maxLength",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "format", "title", "description", "default",
        "examples", "$schema", "$id", "$comment", "nullable", "deprecated", "readOnly", "writeOnly",
    }
)  # fmt: skip
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keyword -> {name: schema}
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # keyword -> [schema]
_SCHEMA_VALUES = ("items", "additionalProperties")  # keyword -> schema (or a bool)
MAX_SCHEMA_DEPTH = 64  # JSON levels: far deeper than any real schema, and well inside Python's recursion limit


def check_json_depth(value: Any, source: str | None = None, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """InvalidRequestError when a JSON value nests deeper than `limit` objects and arrays; measured without
    recursion, before anything that recurses through it (the metaschema check, the compiler) sees it."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            raise InvalidRequestError(_named(source, f"the JSON Schema nests deeper than {limit} levels"), source)
        pending.extend((child, depth + 1) for child in children)


def parse_schema_text(text: str, source: str | None = None) -> Any:
    """A schema's JSON text parsed; InvalidRequestError for malformed JSON or nesting past the parser's limit."""
    try:
        schema = json.loads(text)
    except RecursionError:
        message = f"the JSON Schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
        raise InvalidRequestError(_named(source, message), source) from None
    except ValueError as exc:
        raise InvalidRequestError(_named(source, f"the schema is not valid JSON: {exc}"), source) from None
    check_json_depth(schema, source)
    return schema


def _named(source: str | None, message: str) -> str:
    """The message after the field it is about (`source`: None where the caller prefixes it)."""
    return message if source is None else f"{source}: {message}"


def check_schema_keywords(schema: Any, path: str = "") -> None:
    """InvalidRequestError naming the first keyword the grammar cannot enforce (its JSON path in the message)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"a JSON Schema must be an object or a boolean, got {schema!r} at '{path or '/'}'")
    if path.count("/") > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"the JSON Schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS:
            raise InvalidRequestError(f"the JSON Schema keyword '{key}' (at '{path or '/'}') is not supported")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema_keywords(sub, f"{path}/{key}/{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema_keywords(sub, f"{path}/{key}/{i}")
        elif key in _SCHEMA_VALUES:
            check_schema_keywords(value, f"{path}/{key}")
