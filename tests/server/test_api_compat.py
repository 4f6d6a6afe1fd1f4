"""What a client written for OpenAI or vLLM relies on: the first streamed chunk is the first token (so a client's
TTFT is the engine's), fields the server would not act on are refused by name (or dropped with a warning under
--lenient), 404 for an unknown model, readable errors for image parts and top_logprobs, continuous usage stats."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from tests.lazy import openai
from tests.server.fakes import fake_engine
from tests.server.live import start_server

# A prompt of 96 bytes prefilled 16 tokens a step, 40 ms a step: ~0.25 s before the first token.
SLOW_PREFILL = {"delay_s": 0.04, "max_num_tokens": 16, "max_batch_size": 2}
PROMPT = "the quick brown fox jumps over the lazy dog " * 2 + "and so on"


@pytest.fixture(scope="module")
def server():
    s = start_server(fake_engine(**SLOW_PREFILL), served_model_name="fake")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _engine_ttft(server, before: dict[str, float]) -> float:
    """The engine's TTFT of the one request served since `before` (the /metrics histogram's sum)."""
    server.wait_idle()
    after = server.metrics()
    name = "batchserve:time_to_first_token_seconds"
    assert after[name + "_count"] - before.get(name + "_count", 0) == 1
    return after[name + "_sum"] - before.get(name + "_sum", 0)


def _first_chunk(start: float, stream, text_of) -> tuple[float, object]:
    """When the first chunk came (seconds since `start`, taken before the request was sent) and what it was."""
    chunks = [(time.monotonic() - start, chunk) for chunk in stream]
    first_at, first = chunks[0]
    assert text_of(first), f"the first chunk carries no token: {first}"
    return first_at, first


def test_chat_first_chunk_is_the_first_token_with_the_role(server, client):
    before, start = server.metrics(), time.monotonic()
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, stream=True
    )  # returns with the headers, sent when the request is admitted: long before the first token
    first_at, first = _first_chunk(start, stream, lambda c: c.choices and c.choices[0].delta.content)
    assert first.choices[0].delta.role == "assistant"
    engine_ttft = _engine_ttft(server, before)
    assert engine_ttft > 0.15, "the prefill should take several steps"
    # the client's clock starts before the engine's (HTTP, templating, tokenizing) and stops after it (one chunk's
    # transfer): never earlier, which a chunk sent before the first token was
    assert engine_ttft <= first_at < engine_ttft + 1.0, (first_at, engine_ttft)


def test_completion_first_chunk_is_the_first_token(server, client):
    before, start = server.metrics(), time.monotonic()
    stream = client.completions.create(model="fake", prompt=PROMPT, max_tokens=4, stream=True)
    first_at, _ = _first_chunk(start, stream, lambda c: c.choices and c.choices[0].text)
    engine_ttft = _engine_ttft(server, before)
    assert engine_ttft > 0.15 and engine_ttft <= first_at < engine_ttft + 1.0, (first_at, engine_ttft)


def test_unknown_fields_are_refused_by_name(server):
    for field, value in [("guided_decoding_backend", "xgrammar"), ("anything", 1)]:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and "unknown field" in r.json()["error"]["message"]
    nested = {"messages": [{"role": "user", "content": "hi", "mood": "happy"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=nested, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.mood"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "guided_whitespace_pattern": " "}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_whitespace_pattern"


def test_lenient_server_drops_unknown_fields_with_a_warning(caplog):
    s = start_server(fake_engine(), lenient=True)
    try:
        body = {
            "messages": [{"role": "user", "content": "hi", "mood": "x"}],
            "max_tokens": 3,
            "guided_decoding_backend": "x",
        }
        with caplog.at_level(logging.WARNING):
            r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        warned = [rec.getMessage() for rec in caplog.records if "--lenient" in rec.getMessage()]
        assert warned and "guided_decoding_backend" in warned[0] and "messages.0.mood" in warned[0]
        # lenient is about unknown fields only: a bad value of a known one is still a 400
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": -1, "foo": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    finally:
        s.stop()


def test_unknown_model_is_404_for_the_openai_client(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"top_logprobs": 30, "logprobs": True}, "top_logprobs", "less than or equal to 20"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 150}}, "logit_bias", "[-100.0, 100.0]"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "logit_bias token ids"),  # outside the vocabulary
        ({"tool_choice": "required"}, "tool_choice", "tools"),
    ],
)
def test_chat_fields_are_checked_by_name(server, body, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_image_parts_are_refused_in_words(server):
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages.0.content"
    assert error["message"] == (
        "messages.0.content: only text content parts are supported; this model cannot read a part of type 'image_url'"
    )


def test_text_parts_names_and_tool_choice_none_are_served(server):
    messages = [{"role": "user", "name": "ann", "content": [{"type": "text", "text": "hi"}]}]
    body = {"messages": messages, "max_tokens": 2, "tool_choice": "none", "logit_bias": {"3": -100}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_continuous_usage_stats_count_up_in_every_chunk(server):
    body = {"prompt": "abc", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        import json

        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == [1, 2, 3, 4] and all(c["usage"]["prompt_tokens"] == 3 for c in chunks)


def test_metrics_before_any_request_show_the_pool_and_the_config_without_created_series():
    s = start_server(fake_engine(max_batch_size=3, scheduler_policy="GUARANTEED_NO_EVICT"))
    try:
        text = httpx.get(s.url + "/metrics", timeout=10).text
        assert s.metrics()["batchserve:kv_cache_blocks_total"] == 256
        (info,) = [line for line in text.splitlines() if line.startswith("batchserve:engine_config_info{")]
        for label in ('max_batch_size="3"', 'scheduler_policy="guaranteed_no_evict"', 'num_kv_blocks="256"',
                      'block_size="16"', 'max_model_len="256"'):  # fmt: skip
            assert label in info, info
        assert info.endswith(" 1.0")
        assert "_created" not in text
    finally:
        s.stop()
