"""The scan that refuses a large body's over-bound list before its parse (bounded_fields.py): it refuses what the
parse refuses, with the same status and field, and steps aside wherever it cannot be sure."""

from __future__ import annotations

import json

import pytest

from batchserve.entrypoints.openai.bodies import validated_body
from batchserve.entrypoints.openai.bounded_fields import WALK_TOKENS, bounded_fields, refuse_over_bound
from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.protocol import (
    MAX_TOKEN_IDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
)
from batchserve.entrypoints.openai.responses import ResponsesRequest
from batchserve.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS

BIAS = {str(i): 1 for i in range(100_000)}


def _scan(body: bytes, model=CompletionRequest) -> APIError | None:
    try:
        refuse_over_bound(body, model)
    except APIError as refused:
        return refused
    return None


def _parse(body: bytes, model=CompletionRequest) -> APIError | None:
    try:
        validated_body(body, model, lenient=False)
    except APIError as refused:
        return refused
    return None


def test_the_bounded_fields_come_from_the_request_models():
    assert set(bounded_fields(CompletionRequest)) >= {("logit_bias", MAX_LOGIT_BIAS_ENTRIES),
                                                      ("stop_token_ids", MAX_STOP_TOKEN_IDS)}  # fmt: skip
    assert bounded_fields(DetokenizeRequest) == (("tokens", MAX_TOKEN_IDS),)


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (CompletionRequest, {"prompt": "x", "max_tokens": 4, "logit_bias": BIAS}),
        (CompletionRequest, {"logit_bias": {k: -0.5e1 for k in list(BIAS)[:1025]}, "prompt": [1, 2]}),
        (CompletionRequest, {"prompt": "x", "stop_token_ids": list(range(300_000))}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a, [b] {c}"}] * 50, "logit_bias": BIAS}),
        (DetokenizeRequest, {"tokens": [7] * (MAX_TOKEN_IDS + 1)}),
    ],
)
def test_an_over_bound_field_is_refused_by_the_scan_as_by_the_parse(model, body):
    raw = json.dumps(body).encode()
    scanned, parsed = _scan(raw, model), _parse(raw, model)
    assert scanned is not None and parsed is not None
    assert (scanned.status, scanned.param) == (parsed.status, parsed.param) == (400, scanned.message.split(":")[0])


def test_a_trailing_comma_or_an_empty_list_under_a_zero_bound_is_left_to_the_parse():
    trailing = b'{"prompt": "x", "stop_token_ids": [' + b"1," * MAX_STOP_TOKEN_IDS + b"]}"
    assert _scan(trailing) is None and _parse(trailing).code == "invalid_json"
    assert bounded_fields(ResponsesRequest) == (("include", 0),)  # no extra output data is built
    assert _scan(b'{"model": "m", "input": "hi", "include": [ ]}', ResponsesRequest) is None
    one = b'{"model": "m", "input": "hi", "include": ["reasoning.encrypted_content"]}'
    scanned, parsed = _scan(one, ResponsesRequest), _parse(one, ResponsesRequest)
    assert (scanned.status, scanned.param) == (parsed.status, parsed.param) == (400, "include")


def _steps_aside(body: bytes, model=CompletionRequest) -> None:
    assert _scan(body, model) is None


def test_exactly_the_bound_is_not_refused():
    at_bound = {"prompt": "x", "logit_bias": dict(list(BIAS.items())[:MAX_LOGIT_BIAS_ENTRIES]),
                "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))}  # fmt: skip
    _steps_aside(json.dumps(at_bound).encode())
    assert _parse(json.dumps(at_bound).encode()) is None


def test_the_name_in_a_nested_object_or_a_string_is_not_the_field():
    schema = {"type": "object", "properties": {"logit_bias": BIAS}}  # a schema may name a property so
    nested = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    _steps_aside(json.dumps(nested).encode(), CompletionRequest)
    assert _parse(json.dumps(nested).encode()) is None
    quoted = json.dumps({"prompt": json.dumps({"logit_bias": BIAS}), "max_tokens": 2}).encode()
    _steps_aside(quoted)
    assert _parse(quoted) is None


def test_a_later_duplicate_key_wins_so_the_scan_steps_aside():
    huge = json.dumps({"prompt": "x", "logit_bias": BIAS})[:-1]
    for later in (', "logit_bias": null}', ', "logit\\u005fbias": null}'):
        body = (huge + later).encode()
        _steps_aside(body)
        assert _parse(body) is None  # the last one is the value


def test_values_it_does_not_know_and_long_walks_are_left_to_the_parse():
    _steps_aside(json.dumps({"prompt": "x", "logit_bias": {k: "1" for k in BIAS}}).encode())
    _steps_aside(json.dumps({"prompt": "x", "logit_bias": {f"\\n{k}": 1 for k in BIAS}}).encode())
    many_strings = {"prompt": ["s"] * WALK_TOKENS, "logit_bias": BIAS}
    _steps_aside(json.dumps(many_strings).encode())
    assert _parse(json.dumps(many_strings).encode()).param == "logit_bias"  # the parse still refuses it
