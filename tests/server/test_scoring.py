"""Scoring end to end on SmolLM2-135M-Instruct (what evaluation harnesses send to a completions server)."""

from __future__ import annotations

import math

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


def _num_prompt_tokens(real_server, prompt: str) -> int:
    return httpx.post(real_server.url + "/tokenize", json={"prompt": prompt}).json()["count"]


def test_echo_logprobs_max_tokens_0_scores_every_prompt_token(real_server, client):
    out = client.completions.create(model=real_server.model_id(), prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    choice, count = out.choices[0], _num_prompt_tokens(real_server, PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == count
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 and math.isfinite(x) for x in lp.token_logprobs[1:])
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == PROMPT
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == count
    # a likely continuation scores higher than an unlikely one: the scores mean something
    assert lp.token_logprobs[-2] > math.log(0.05)  # "Rome" after "the capital of Italy is"


def test_echo_with_generation_lists_prompt_then_output_and_matches_the_stream(real_server, client):
    args = dict(model=real_server.model_id(), prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0)
    full = client.completions.create(**args).choices[0]
    count = _num_prompt_tokens(real_server, PROMPT)
    assert len(full.logprobs.tokens) == count + 4 and full.text.startswith(PROMPT)
    streamed, tokens = "", []
    for chunk in client.completions.create(stream=True, **args):
        if chunk.choices:
            streamed += chunk.choices[0].text
            tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
    assert streamed == full.text and tokens == full.logprobs.tokens


def test_vllm_prompt_logprobs_and_scores_equal_the_generated_tokens_logprob(real_server, client):
    model = real_server.model_id()
    gen = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    token, logprob = gen.choices[0].logprobs.tokens[0], gen.choices[0].logprobs.token_logprobs[0]
    scored = httpx.post(real_server.url + "/v1/completions", json={"prompt": PROMPT + token, "max_tokens": 1,
                        "prompt_logprobs": 2}, timeout=60).json()["choices"][0]["prompt_logprobs"]  # fmt: skip
    assert scored[0] is None and len(scored) == _num_prompt_tokens(real_server, PROMPT + token)
    last = scored[-1]
    (own_id, own), *_ = last.items()
    assert own["decoded_token"] == token and own["rank"] == 1
    assert own["logprob"] == pytest.approx(logprob, abs=1e-3)  # the prefill's score equals the decode's


def test_max_tokens_0_without_echo_is_a_400(real_server):
    r = httpx.post(real_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
