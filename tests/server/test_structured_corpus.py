"""Structured outputs on the default model (SmolLM2): every schema of the shipped corpus, greedy and at temperature
1, yields JSON that parses and validates (jsonschema). One engine, every request batched through it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from batchserve.entrypoints.llm import LLM
from batchserve.sampling_params import SamplingParams
from batchserve.serving.structured import json_schema_constraint

CORPUS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
MAX_TOKENS = 160  # every corpus schema admits outputs far shorter: an output cut at the budget is a failure


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=1024, max_batch_size=128, dtype="float32", max_model_len=512)


def _prompt(entry: dict) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give an example of a {entry['title'].replace('_', ' ')} as JSON."}]


def test_the_corpus_is_large_and_varied():
    text = json.dumps([c["schema"] for c in CORPUS])
    assert len(CORPUS) >= 50
    for keyword in ("$ref", "anyOf", "pattern", "enum", "minItems", "maxItems", "minimum", "maximum", '"required"'):
        assert keyword in text, keyword
    for entry in CORPUS:
        jsonschema.validators.validator_for(entry["schema"]).check_schema(entry["schema"])


def test_a_sample_of_the_corpus_validates_greedy(llm):
    """The always-run part: a few varied schemas ($ref, anyOf, pattern, bounded arrays, enums, ranges), greedy."""
    titles = ("ref_defs", "anyof_objects", "pattern_date", "tags_bounded", "weather", "optional_fields")
    _check(llm, [e for e in CORPUS if e["title"] in titles], temperatures=(0.0,), max_tokens=96)


@pytest.mark.slow
def test_every_output_parses_and_validates_greedy_and_at_temperature_1(llm):
    _check(llm, CORPUS, temperatures=(0.0, 1.0), max_tokens=MAX_TOKENS)


def _check(llm, corpus: list[dict], temperatures: tuple[float, ...], max_tokens: int) -> None:
    conversations, params, schemas = [], [], []
    for temperature in temperatures:
        for i, entry in enumerate(corpus):
            constraint = json_schema_constraint(entry["schema"], "response_format")
            conversations.append(_prompt(entry))
            params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                                         structured_outputs=constraint))
            schemas.append(entry)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    failures = []
    for entry, param, out in zip(schemas, params, outputs, strict=True):
        try:
            assert out.finish_reason == "stop", f"finish_reason {out.finish_reason}"
            jsonschema.validate(json.loads(out.text), entry["schema"])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{entry['title']} T={param.temperature}: {out.text!r}: {str(exc)[:200]}")
    assert not failures, "\n".join(failures)
