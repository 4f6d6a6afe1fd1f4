"""Structured outputs at the edge: the request fields that ask for a constraint (OpenAI's `response_format`, vLLM's
`guided_*` and `structured_outputs`) -> one StructuredOutputsParams, and a check that it compiles, in time, before
the request reaches the engine: a bad schema, regex or grammar is a 400 naming its field, never an engine error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import jsonschema

from batchserve.sampling_params import ConstraintKind, InvalidRequestError, StructuredOutputsParams
from batchserve.worker.structured_output import (
    check_json_depth,
    compile_constraint,
    new_compiler,
    parse_schema_text,
)

# A grammar whose compilation takes longer is refused: the engine would compile it again, inside its step loop.
COMPILE_TIMEOUT_S = 10.0
MAX_CHOICES = 1024
# vLLM's structured_outputs fields this server acts on; the others (backend knobs) are answered 400 by name.
_STRUCTURED_FIELDS = {"json": ConstraintKind.JSON, "regex": ConstraintKind.REGEX, "choice": ConstraintKind.CHOICE,
                      "grammar": ConstraintKind.GRAMMAR, "json_object": ConstraintKind.JSON_OBJECT}  # fmt: skip


def canonical_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_schema_constraint(schema: Any, source: str) -> StructuredOutputsParams:
    """A JSON Schema given as an object or as JSON text, checked against its metaschema (after its nesting depth,
    which the metaschema check would otherwise recurse through)."""
    if isinstance(schema, str):
        schema = parse_schema_text(schema, source)
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"{source}: a JSON Schema must be an object", source)
    check_json_depth(schema, source)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequestError(f"{source}: invalid JSON Schema: {exc.message}", source) from None
    return StructuredOutputsParams(ConstraintKind.JSON, canonical_json(schema), source)


def from_response_format(response_format: Mapping[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(ConstraintKind.JSON_OBJECT, "", "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidRequestError("response_format: json_schema needs a json_schema object", "response_format")
        if "schema" not in spec:  # OpenAI allows it: any JSON object
            return StructuredOutputsParams(ConstraintKind.JSON_OBJECT, "", "response_format")
        return json_schema_constraint(spec["schema"], "response_format")
    raise InvalidRequestError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format"
    )


def constraint_for(field: str, value: Any, source: str) -> StructuredOutputsParams:
    """The constraint of one of vLLM's structured_outputs fields (json, regex, choice, grammar, json_object) given
    by another front end; errors name `source`."""
    return _one(_STRUCTURED_FIELDS[field], value, source)


def _one(kind: ConstraintKind, value: Any, source: str) -> StructuredOutputsParams:
    if kind == ConstraintKind.JSON:
        return json_schema_constraint(value, source)
    if kind == ConstraintKind.JSON_OBJECT:
        return StructuredOutputsParams(kind, "", source)
    if kind == ConstraintKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError(f"{source}: choices must be a non-empty list of non-empty strings", source)
        if len(value) > MAX_CHOICES:
            raise InvalidRequestError(f"{source}: at most {MAX_CHOICES} choices", source)
        return StructuredOutputsParams(kind, canonical_json(value), source)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{source} must be a non-empty string", source)
    return StructuredOutputsParams(kind, value, source)


def constraint_of(
    response_format: Mapping[str, Any] | None = None,
    guided: Mapping[str, Any] | None = None,
    structured_outputs: Mapping[str, Any] | None = None,
) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, from whichever field asks; 400 when two ask, or a field is wrong.
    `guided`: vLLM's guided_json / guided_regex / guided_choice / guided_grammar, by name (None when unset)."""
    found: list[StructuredOutputsParams] = []
    if (rf := from_response_format(response_format)) is not None:
        found.append(rf)
    for name, value in (guided or {}).items():
        if value is not None:
            found.append(_one(_STRUCTURED_FIELDS[name.removeprefix("guided_")], value, name))
    for name, value in (structured_outputs or {}).items():
        if name not in _STRUCTURED_FIELDS:
            raise InvalidRequestError(f"structured_outputs.{name} is not supported", "structured_outputs")
        if value is not None and value is not False:
            found.append(_one(_STRUCTURED_FIELDS[name], value, "structured_outputs"))
    if len(found) > 1:
        sources = ", ".join(sorted({c.source for c in found}))
        raise InvalidRequestError(f"a request may ask for one output constraint, got several ({sources})", found[1].source)
    return found[0] if found else None


class ConstraintChecker:
    """Compiles each constraint once before admission (the compiler caches it), in a worker thread and within
    COMPILE_TIMEOUT_S. A compile that overruns keeps its thread until it ends; the request is refused at once."""

    def __init__(self, tokenizer: Any, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._compiler = None

    def _compile(self, constraint: StructuredOutputsParams) -> None:
        if self._compiler is None:
            eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
            self._compiler = new_compiler(self.tokenizer, len(self.tokenizer), eos)
        compile_constraint(self._compiler, constraint)

    def check_blocking(self, constraint: StructuredOutputsParams | None) -> None:
        """As check, on the caller's thread (the offline LLM, which has no event loop to keep free)."""
        if constraint is not None:
            self._compile(constraint)

    async def check(self, constraint: StructuredOutputsParams | None) -> None:
        if constraint is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self._compile, constraint), self.timeout_s)
        except TimeoutError:
            raise InvalidRequestError(
                f"{constraint.source}: the {constraint.kind.value} took over {self.timeout_s:g} s to compile",
                constraint.source,
            ) from None
