"""End to end on SmolLM2-135M-Instruct: the official openai client against a live server on loopback."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from batchserve.serving.metrics import parse_metrics
from tests.lazy import openai

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


def test_chat_streams_incrementally_and_matches_non_streaming(real_server, client):
    model = real_server.model_id()
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
    expected = full.choices[0].message.content
    assert expected and full.usage.completion_tokens == 24 or full.choices[0].finish_reason == "stop"

    start = time.monotonic()
    arrivals, pieces, usage = [], [], None
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - start)
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == expected
    assert usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage, k) for k in counts] == [getattr(full.usage, k) for k in counts]
    # the same prompt again: every full block of it but the last token's comes from the prefix cache (blocks of 16)
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16 > 0
    assert len(arrivals) >= 8
    assert arrivals[0] < 0.5 * arrivals[-1], arrivals  # the first token came long before the last


def test_completion_streams_incrementally_and_matches_non_streaming(real_server, client):
    model = real_server.model_id()
    prompt = "The three primary colors are"
    full = client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.usage.completion_tokens == 24
    assert (
        full.usage.prompt_tokens == httpx.post(real_server.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    )
    start = time.monotonic()
    arrivals, pieces = [], []
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.monotonic() - start)
            pieces.append(chunk.choices[0].text)
    assert "".join(pieces) == full.choices[0].text
    assert arrivals[0] < 0.5 * arrivals[-1], arrivals


def test_64_concurrent_streams_with_16_killed(real_server):
    """64 streaming chat clients at once; 16 leave mid-stream. The rest get exact usage, /metrics shows a batch of
    requests running together, and afterwards no KV block is left in use."""
    url = real_server.url
    model = real_server.model_id()
    prompts = [f"Count from {i} to {i + 10}." for i in range(64)]
    prompt_tokens = {
        p: httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": p}]}).json()["count"]
        for p in prompts
    }
    before = parse_metrics(httpx.get(url + "/metrics").text)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        done = asyncio.Event()
        max_running = 0

        async def watch_metrics():
            nonlocal max_running
            async with httpx.AsyncClient() as http:
                deadline = time.monotonic() + 300
                while not done.is_set() and time.monotonic() < deadline:
                    m = parse_metrics((await http.get(url + "/metrics")).text)
                    max_running = max(max_running, m.get("batchserve:num_requests_running", 0))
                    # the server shares this process: each scrape (rendered, then parsed here) takes the GIL from
                    # the engine loop, and 64 streams keep a batch running for seconds, far longer than a poll
                    await asyncio.sleep(0.25)

        async def one(i: int):
            killed = i % 4 == 0  # 16 of 64
            stream = await aclient.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompts[i]}],
                stream=True,
                max_tokens=200 if killed else 16,
                temperature=0.8 if i % 2 else 0,
                seed=i,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, usage, chunks = "", None, 0
            async for chunk in stream:
                chunks += 1
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if killed and chunks >= 3:
                    await stream.close()  # the client goes away mid-stream
                    return i, None, text
            return i, usage, text

        watcher = asyncio.create_task(watch_metrics())
        results = await asyncio.gather(*(one(i) for i in range(64)))
        done.set()
        await watcher
        await aclient.close()
        return results, max_running

    results, max_running = asyncio.run(run())
    finished = [(i, usage, text) for i, usage, text in results if usage is not None]
    assert len(finished) == 48
    for i, usage, text in finished:
        assert text
        assert usage.completion_tokens == 16
        assert usage.prompt_tokens == prompt_tokens[prompts[i]]
        assert usage.total_tokens == usage.prompt_tokens + 16
    assert max_running > 1, "requests never ran in one batch"

    real_server.wait_idle()
    stats = real_server.engine.last_stats
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    after = parse_metrics(httpx.get(url + "/metrics").text)
    assert after["batchserve:kv_cache_blocks_used"] == 0
    assert after["batchserve:kv_cache_usage_perc"] == 0
    assert after["batchserve:num_requests_running"] == 0
    assert after["batchserve:request_success_total"] - before.get("batchserve:request_success_total", 0) == 64
    generated = after["batchserve:generation_tokens_total"] - before.get("batchserve:generation_tokens_total", 0)
    assert 48 * 16 <= generated < 48 * 16 + 16 * 200  # the killed ones stopped early


def test_bad_inputs_then_good_request(real_server, client):
    model = real_server.model_id()
    url = real_server.url
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.status_code == 404 and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:  # over max_input_len (511), truncation="error"
        client.completions.create(model=model, prompt="hello " * 700, max_tokens=2)
    assert "511" in err.value.body["message"] and err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=-0.5)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, top_p=1.5, stream=True)
    bad_json = httpx.post(
        url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    too_big = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "a " * 200_000})
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "invalid_request_error"
    ok = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content and ok.usage.completion_tokens <= 4


def test_logit_bias_bans_and_forces_tokens(real_server, client):
    model = real_server.model_id()

    def first_token(**extra) -> str:
        out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                         **extra)  # fmt: skip
        return out.choices[0].text

    def token_id(text: str) -> int:
        body = {"prompt": text, "add_special_tokens": False}
        (tid,) = httpx.post(real_server.url + "/tokenize", json=body).json()["tokens"]
        return tid

    assert first_token() == " Paris"
    assert first_token(logit_bias={str(token_id(" Paris")): -100}) != " Paris"
    assert first_token(logit_bias={str(token_id(" London")): 100}) == " London"
