"""Structured outputs at the edge: the request fields that ask for a constraint (OpenAI's `response_format`, vLLM's
`guided_*` and `structured_outputs`) -> one StructuredOutputsParams, and a check that it compiles, in time, before
the request reaches the engine: a bad schema, regex or grammar is a 400 naming its field, never an engine error."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping
from typing import Any

import jsonschema

from batchserve.sampling_params import ConstraintKind, InvalidRequestError, StructuredOutputsParams
from batchserve.serving.grammar_pool import (
    COMPILE_TIMEOUT_S,
    MAX_CONSTRAINT_BYTES,
    GrammarCompilePool,
    tokenizer_info_json,
    too_large,
)
from batchserve.worker.json_schema_checks import check_json_depth, check_schema_keywords, parse_schema_text

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
        _check_size(ConstraintKind.JSON, schema, source)
        schema = parse_schema_text(schema, source)
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"{source}: a JSON Schema must be an object", source)
    check_json_depth(schema, source)
    spec = canonical_json(schema)  # measured before the metaschema check, which takes seconds a megabyte
    _check_size(ConstraintKind.JSON, spec, source)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequestError(f"{source}: invalid JSON Schema: {exc.message}", source) from None
    return StructuredOutputsParams(ConstraintKind.JSON, spec, source)


def _check_size(kind: ConstraintKind, spec: str, source: str) -> None:
    """A constraint over MAX_CONSTRAINT_BYTES is refused before anything parses or compiles it."""
    if len(spec) > MAX_CONSTRAINT_BYTES // 4 and len(spec.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
        raise too_large(StructuredOutputsParams(kind, "", source), len(spec.encode("utf-8", "surrogatepass")))


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
        spec = canonical_json(value)
        _check_size(kind, spec, source)
        return StructuredOutputsParams(kind, spec, source)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{source} must be a non-empty string", source)
    _check_size(kind, value, source)
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
        raise InvalidRequestError(
            f"a request may ask for one output constraint, got several ({sources})", found[1].source
        )
    return found[0] if found else None


class ConstraintChecker:
    """Compiles each constraint once before admission, in a child process (serving/grammar_pool.py) that is killed
    when its compile overruns `timeout_s`; a constraint larger than `max_constraint_bytes` is refused unparsed."""

    def __init__(
        self,
        tokenizer: Any,
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_constraint_bytes: int = MAX_CONSTRAINT_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.max_constraint_bytes = max_constraint_bytes
        self._pool: GrammarCompilePool | None = None
        self._pool_lock = threading.Lock()

    @property
    def pool(self) -> GrammarCompilePool:
        """Built at the first constraint (reading the vocabulary takes a moment): a server that never sees one
        starts no child process."""
        with self._pool_lock:
            if self._pool is None:
                eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
                info = tokenizer_info_json(self.tokenizer, len(self.tokenizer), eos)
                self._pool = GrammarCompilePool(info, self.timeout_s, self.max_constraint_bytes)
            return self._pool

    def check_blocking(self, constraint: StructuredOutputsParams | None) -> None:
        """Returns once the constraint compiles; InvalidRequestError otherwise (the offline LLM calls this on its
        own thread; the server through check)."""
        if constraint is None:
            return
        if constraint.kind == ConstraintKind.JSON and len(constraint.spec) <= self.max_constraint_bytes:
            try:  # what needs no compiler is checked here, without a round trip to the child
                check_schema_keywords(parse_schema_text(constraint.spec))
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"{constraint.source}: {exc}", constraint.source) from None
        self.pool.check(constraint)

    async def check(self, constraint: StructuredOutputsParams | None) -> None:
        """As check_blocking, in a worker thread: the event loop streams everyone's tokens meanwhile."""
        if constraint is not None:
            await asyncio.to_thread(self.check_blocking, constraint)

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
