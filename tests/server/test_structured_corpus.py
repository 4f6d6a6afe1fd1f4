"""Structured outputs on the default model (SmolLM2): every schema of the shipped corpus, greedy and at temperature
1, yields JSON that parses and validates (jsonschema). One engine, every request batched through it.

In bfloat16, the file dequantized: what is checked here (the grammar's masks, the outputs' validity) holds in any
dtype, and on a CPU with bf16 matmul units the corpus's batch of 106 rows costs a little over half of what it costs
in float32 (docs/BENCHMARKS.md, the test suite); elsewhere the weights are widened to float32 and it costs what
float32 does."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import pytest

from batchserve.entrypoints.llm import LLM
from batchserve.sampling_params import SamplingParams
from batchserve.serving.structured import json_schema_constraint

CORPUS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
REPEATING = [{"role": "user", "content": "Repeat exactly: apples, pears, plums. apples, pears, plums. apples,"}]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 160  # every corpus schema admits outputs far shorter: an output cut at the budget is a failure


ENGINE = {"dtype": "bfloat16", "quantization": "none"}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=1024, max_batch_size=128, max_model_len=512, **ENGINE)


def _prompt(entry: dict) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give an example of a {entry['title'].replace('_', ' ')} as JSON."}]


def test_the_corpus_is_large_and_varied():
    text = json.dumps([c["schema"] for c in CORPUS])
    assert len(CORPUS) >= 50
    for keyword in ("$ref", "anyOf", "pattern", "enum", "minItems", "maxItems", "minimum", "maximum", '"required"'):
        assert keyword in text, keyword
    for entry in CORPUS:
        jsonschema.validators.validator_for(entry["schema"]).check_schema(entry["schema"])


@pytest.mark.slow
def test_every_output_parses_and_validates_greedy_and_at_temperature_1(llm):
    _check(llm, CORPUS, temperatures=(0.0, 1.0), max_tokens=MAX_TOKENS)


def _check(llm, corpus: list[dict], temperatures: tuple[float, ...], max_tokens: int) -> None:
    conversations, params, schemas = [], [], []
    for temperature in temperatures:
        for i, entry in enumerate(corpus):
            constraint = json_schema_constraint(entry["schema"], "response_format")
            conversations.append(_prompt(entry))
            params.append(
                SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured_outputs=constraint)
            )
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


def _fill_threads(llm) -> list[str]:
    """Records the thread of every mask fill of the engine's worker (its own list per call)."""
    structured, names = llm.engine.runner.structured_outputs, []
    fill = type(structured).fill_rows  # the method itself, not an earlier call's wrapper

    def recorded(bitmask, rows):
        names.append(threading.current_thread().name)
        return fill(bitmask, rows)

    structured.fill_rows = recorded
    return names


@pytest.mark.parametrize("speculative", [False, True])
def test_masks_filled_during_the_forward_pass_give_the_same_greedy_outputs(llm, speculative):
    """Overlap on and off: token-identical constrained outputs; with it on the fills ran in the worker thread. With
    speculation, free requests drafted beside the constrained ones (the constrained rows are a subset of the step's)."""
    engine = LLM(num_kv_blocks=256, speculative_config=SPEC, **ENGINE) if speculative else llm
    structured = engine.engine.runner.structured_outputs
    titles = ("ref_defs", "tags_bounded")
    conversations = [_prompt(e) for e in CORPUS if e["title"] in titles] + [REPEATING] * 2
    constraints = [json_schema_constraint(e["schema"], "response_format") for e in CORPUS if e["title"] in titles]
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=c) for c in constraints + [None, None]]
    outputs, threads = {}, {}
    try:
        for overlap in (True, False):
            structured.overlap = overlap
            threads[overlap] = _fill_threads(engine)
            outputs[overlap] = [(o.token_ids, o.text) for o in engine.chat(conversations, params, use_tqdm=False)]
    finally:
        structured.overlap = True
        del structured.fill_rows
    assert outputs[True] == outputs[False]
    assert set(threads[True]) == {"batchserve-grammar-masks_0"}
    assert threads[False] and "batchserve-grammar-masks_0" not in threads[False]
    if speculative:
        assert engine.engine.scheduler.speculation.stats.num_accepted > 0  # drafts ran in the constrained steps
