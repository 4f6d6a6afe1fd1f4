"""The JSON grammar bounds a number's digits: a model that loops on digits closes its JSON inside max_tokens."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import BaseModel

from batchserve.sampling_params import ConstraintKind, SamplingParams, StructuredOutputsParams
from batchserve.worker.sampler import Sampler, SamplingMetadata
from batchserve.worker.structured_output import NumberBounds, StructuredOutputs, json_grammar

CPU = torch.device("cpu")
MAX_TOKENS = 64


class Reading(BaseModel):
    value: float
    count: int


@pytest.fixture(scope="module")
def tokenizer():
    from batchserve.models.loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path(), None)


@pytest.fixture(scope="module")
def digit_loving_logits(tokenizer) -> torch.Tensor:
    """The logits of a model stuck on digits: every token that is only digits far above the rest, '1' highest."""
    logits = torch.randn(1, len(tokenizer), generator=torch.Generator().manual_seed(0))
    for token_id, text in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if text and text.isdigit():
            logits[0, token_id] += 20.0 + (5.0 if set(text) == {"1"} else 0.0)
    return logits


@pytest.fixture(scope="module")
def structured(tokenizer) -> StructuredOutputs:
    """One worker state for the module: its compiler walks the vocabulary once."""
    return StructuredOutputs(len(tokenizer), [tokenizer.eos_token_id], tokenizer)


def decode_at_most(structured: StructuredOutputs, logits: torch.Tensor, eos: int, max_tokens: int) -> list[int] | None:
    """Greedy under the grammar's mask -> the tokens before EOS, or None when max_tokens ran out first."""
    out: list[int] = []
    for _ in range(max_tokens):
        mask = structured.fill_masks(["r"])
        meta = SamplingMetadata.build([SamplingParams(temperature=0.0)], [[1]], [1], [eos], structured.vocab_size,
                                      CPU, token_bitmask=mask)  # fmt: skip
        token = Sampler()(logits.clone(), meta).token_ids.tolist()
        structured.accept(["r"], token)
        if token[0] == eos:
            return out
        out += token
    return None


def run(tokenizer, structured, logits, constraint: StructuredOutputsParams) -> str | None:
    structured.add("r", constraint)
    try:
        tokens = decode_at_most(structured, logits, tokenizer.eos_token_id, MAX_TOKENS)
    finally:
        structured.remove(["r"])
    return None if tokens is None else tokenizer.decode(tokens)


def schema_of(model: type[BaseModel]) -> StructuredOutputsParams:
    return StructuredOutputsParams(ConstraintKind.JSON, json.dumps(model.model_json_schema()), "response_format")


def test_a_model_looping_on_digits_closes_valid_json_inside_max_tokens(tokenizer, structured, digit_loving_logits):
    text = run(tokenizer, structured, digit_loving_logits, schema_of(Reading))
    assert text is not None, f"no EOS within {MAX_TOKENS} tokens"
    reading = Reading.model_validate_json(text)
    assert "1" * 16 in text and "1" * 17 not in text, text  # the model wanted more digits: the bound stopped it
    assert reading.count == int("1" * 16)


def test_without_the_bound_the_same_model_runs_to_max_tokens(tokenizer, structured, digit_loving_logits, monkeypatch):
    """The override (0 lifts the bound) shows what the bound prevents."""
    monkeypatch.setenv("BATCHSERVE_JSON_INTEGER_DIGITS", "0")
    monkeypatch.setenv("BATCHSERVE_JSON_FRACTION_DIGITS", "0")
    assert run(tokenizer, structured, digit_loving_logits, schema_of(Reading)) is None


def test_the_bound_is_overridable(tokenizer, structured, digit_loving_logits, monkeypatch):
    monkeypatch.setenv("BATCHSERVE_JSON_INTEGER_DIGITS", "3")
    monkeypatch.setenv("BATCHSERVE_JSON_FRACTION_DIGITS", "2")
    text = run(tokenizer, structured, digit_loving_logits, schema_of(Reading))
    reading = Reading.model_validate_json(text)
    assert reading.count == 111 and int(reading.value) == 111 and "1111" not in text, text


def test_json_object_mode_and_one_sided_ranges_are_bounded_too(tokenizer, structured, digit_loving_logits):
    any_object = json_grammar('{"type": "object"}', NumberBounds(), strict_mode=False)  # json_object's grammar
    assert "[1-9] [0-9]{0, 15}" in any_object and "basic_number_digits{1, 16}" in any_object
    assert "basic_number_digits{1, -1}" not in any_object and "[0-9]*" not in any_object
    positive = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}
    text = run(
        tokenizer,
        structured,
        digit_loving_logits,
        StructuredOutputsParams(ConstraintKind.JSON, json.dumps(positive), "x"),
    )
    assert text is not None and 0 <= json.loads(text)["n"] < 10**16


def test_a_range_the_schema_gives_is_kept():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 100}}}
    grammar = json_grammar(json.dumps(schema), NumberBounds())
    assert '"1" "0" "0"' in grammar  # xgrammar's own range rules, untouched
    unbounded = json_grammar(json.dumps(schema), NumberBounds(0, 0, 0))
    assert "[0-9]{0, 15}" in grammar and "[0-9]{0, 15}" not in unbounded
