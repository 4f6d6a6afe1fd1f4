"""The HTTP server over the real engine with a model-free runner: routes, streaming, errors, auth, aborts, metrics.
Fast (no model); the same checks on SmolLM2 are in test_openai_e2e.py."""

from __future__ import annotations

import asyncio
import json
import signal
import textwrap
import time

import httpx
import pytest

from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.sampling_params import SamplingParams
from tests.server.fakes import fake_engine
from tests.server.live import server_process, start_server

MODEL = "fake"


@pytest.fixture(scope="module")
def server():
    s = start_server(fake_engine(delay_s=0.002), served_model_name=[MODEL, "alias"], max_body_bytes=16 * 1024)
    yield s
    s.stop()


def post(server, path, body, **kwargs):
    return httpx.post(server.url + path, json=body, timeout=30, **kwargs)


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream(server, path, body) -> list:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


# ------------------------------------------------------------------------------------------------ happy paths
def test_models_health_tokenize(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"]
    assert models["data"][0]["max_model_len"] == 256
    tok = post(server, "/tokenize", {"prompt": "hello"}).json()
    assert tok["count"] == 5 and len(tok["tokens"]) == 5
    assert post(server, "/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": "hello"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 5


def test_completion_stream_matches_non_streaming(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    full = post(server, "/v1/completions", body).json()
    assert full["object"] == "text_completion"
    (choice,) = full["choices"]
    assert choice["finish_reason"] == "length" and len(choice["text"]) == 12
    assert full["usage"] == {
        "prompt_tokens": 16, "completion_tokens": 12, "total_tokens": 28, "prompt_tokens_details": {"cached_tokens": 0}
    }  # fmt: skip

    events = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) > 3  # one chunk per token, not one blob


def test_chat_stream_matches_non_streaming(server):
    body = {"model": "alias", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 10, "temperature": 0}
    full = post(server, "/v1/chat/completions", body).json()
    assert full["object"] == "chat.completion"
    message = full["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"]) == 10
    prompt_tokens = post(server, "/tokenize", {"messages": body["messages"]}).json()["count"]
    assert full["usage"]["prompt_tokens"] == prompt_tokens and full["usage"]["completion_tokens"] == 10

    events = stream(server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_batched_prompts_and_logprobs(server):
    ids = post(server, "/v1/completions", {"prompt": [[3, 4, 5], [6, 7]], "max_tokens": 2}).json()
    assert [c["index"] for c in ids["choices"]] == [0, 1] and ids["usage"]["prompt_tokens"] == 5
    body = {"prompt": ["abc", "xyz", "hello"], "max_tokens": 4, "temperature": 0, "logprobs": 0}
    full = post(server, "/v1/completions", body).json()
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert full["usage"]["completion_tokens"] == 12 and full["usage"]["prompt_tokens"] == 11
    assert all(
        set(c["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"} for c in full["choices"]
    )
    events = stream(server, "/v1/completions", {**body, "logprobs": None})
    texts = {i: "" for i in range(3)}
    for chunk in events[:-1]:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in full["choices"]]


def test_stop_string(server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    text = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    stop = text[5:7]
    cut = post(server, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop" and cut["stop_reason"] == stop


# ------------------------------------------------------------------------------------------------ bad input
def _error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


BAD = [
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),  # as OpenAI and vLLM answer an unknown model
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [999999]}, 400, "prompt"),
    ({"prompt": "x" * 300}, 400, "prompt"),  # over max_input_len (truncation=error)
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"max_tokens": 4}, 400, "prompt"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_completion_requests(server, body, status, param):
    _error(post(server, "/v1/completions", body), status, param)
    ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_bad_chat_and_transport(server):
    chat = "/v1/chat/completions"
    _error(post(server, chat, {"messages": []}), 400, "messages")
    _error(post(server, chat, {"messages": [{"role": "wizard", "content": "x"}]}), 400)
    _error(post(server, chat, {"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404, "model")
    _error(post(server, chat, {"messages": [{"role": "user", "content": "x"}], "temperature": -2}), 400, "temperature")
    bad_json = httpx.post(server.url + chat, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert _error(bad_json, 400)["code"] == "invalid_json"
    assert _error(httpx.post(server.url + chat, content=b"[1, 2]"), 400)
    big = {"messages": [{"role": "user", "content": "x" * (20 * 1024)}]}
    assert _error(post(server, chat, big), 413)["code"] == "body_too_large"
    _error(httpx.get(server.url + "/v1/nothing"), 404)
    _error(post(server, "/detokenize", {"tokens": [-1]}), 400, "tokens")
    # a streaming request that is invalid fails before the stream starts, with a status code
    _error(post(server, "/v1/completions", {"prompt": "", "stream": True}), 400, "prompt")
    ok = post(server, chat, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


# ------------------------------------------------------------------------------------------------ aborts
def test_client_disconnects_free_their_blocks(server):
    before = server.metrics().get("batchserve:request_success_total", 0)
    for _ in range(3):  # streaming clients that leave after two chunks
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 200, "stream": True}
        ) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 2:
                    break
    with pytest.raises(httpx.TimeoutException):  # a non-streaming client that gives up
        httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 240}, timeout=0.2)
    deadline = time.monotonic() + 10
    while server.async_engine.num_active_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    server.wait_idle()
    stats = server.engine.last_stats
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    metrics = server.metrics()
    assert metrics["batchserve:kv_cache_blocks_used"] == 0
    assert metrics["batchserve:request_success_total"] >= before + 4
    # none of them ran to max_tokens: they were aborted early
    text = httpx.get(server.url + "/metrics").text
    aborted = [line for line in text.splitlines() if 'finished_reason="abort"' in line and not line.startswith("#")]
    assert aborted and float(aborted[0].rsplit(" ", 1)[1]) >= 4


def test_metrics_names(server):
    post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    metrics = server.metrics()
    for name in [
        "batchserve:num_requests_running",
        "batchserve:num_requests_waiting",
        "batchserve:num_requests_swapped",
        "batchserve:kv_cache_usage_perc",
        "batchserve:prefix_cache_hit_rate",
        "batchserve:num_preemptions_total",
        "batchserve:prompt_tokens_total",
        "batchserve:generation_tokens_total",
        "batchserve:time_to_first_token_seconds_count",
        "batchserve:time_per_output_token_seconds_count",
        "batchserve:e2e_request_latency_seconds_count",
        "batchserve:request_queue_time_seconds_count",
        "batchserve:iteration_time_seconds_count",
        "batchserve:iteration_tokens_total_count",
        "batchserve:step_phase_seconds_total",
    ]:
        assert name in metrics, name
    assert metrics["batchserve:generation_tokens_total"] >= 3
    phases = {line.split('phase="')[1].split('"')[0] for line in httpx.get(server.url + "/metrics").text.splitlines()
              if line.startswith("batchserve:step_phase_seconds_total{")}  # fmt: skip
    assert phases == {"schedule", "prepare", "forward", "sample", "output"}
    assert metrics["batchserve:step_phase_seconds_total"] > 0
    assert metrics["batchserve:e2e_request_latency_seconds_count"] >= 1


# ------------------------------------------------------------------------------------------------ overload, auth, death
def test_full_queue_answers_503_with_retry_after():
    s = start_server(fake_engine(delay_s=0.02, max_batch_size=1, max_waiting_requests=2))
    try:

        async def burst():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                body = {"prompt": "hi", "max_tokens": 5}
                return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 503 in codes, codes
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert _error(r, 503)["code"] == "queue_full"
        s.wait_idle()
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        s.stop()


def test_api_key():
    s = start_server(fake_engine(), api_key="s3cret")
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert _error(httpx.post(s.url + "/v1/completions", json=body), 401)["code"] == "invalid_api_key"
        wrong = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        _error(wrong, 401)
        _error(httpx.get(s.url + "/v1/models"), 401)
        good = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
    finally:
        s.stop()


def test_engine_crash_fails_requests_and_health():
    engine = fake_engine(delay_s=0.01)
    s = start_server(engine)
    try:
        with httpx.stream(
            "POST", s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 200, "stream": True}
        ) as r:
            lines = r.iter_lines()
            next(lines)
            engine.runner.crash.set()
            events = sse_events(lines)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert _error(httpx.post(s.url + "/v1/completions", json={"prompt": "a"}), 503)["code"] == "engine_dead"
        assert httpx.get(s.url + "/health").status_code == 503
    finally:
        s.stop()


# ------------------------------------------------------------------------------------------------ async engine
def test_async_engine_streams_and_drains():
    engine = fake_engine(delay_s=0.002)
    async_engine = AsyncLLMEngine(engine).start()

    async def run():
        params = SamplingParams(max_tokens=6, temperature=0)
        outs = [o async for o in async_engine.generate("abc", params, "r1")]
        assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5, 6] and outs[-1].finished
        assert all(len(o.delta_token_ids) == 1 for o in outs)  # each step's token, not all so far
        # an early exit aborts the request
        async for _ in async_engine.generate("abc", SamplingParams(max_tokens=100), "r2"):
            break
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_unfinished_requests() and engine.last_stats.kv_blocks_used == 0
        # shutdown with drain: a request in flight still completes
        agen = async_engine.generate("abc", SamplingParams(max_tokens=20), "r3")
        first = await agen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        rest = [o async for o in agen]
        assert rest[-1].num_output_tokens == 20 and rest[-1].finished and not first.finished
        assert sum(len(o.delta_token_ids) for o in [first, *rest]) == 20

    asyncio.run(run())
    assert not async_engine.is_running


SERVE_SCRIPT = textwrap.dedent(
    """
    import sys
    from batchserve.engine.async_engine import AsyncLLMEngine
    from batchserve.entrypoints.openai.app import build_app
    from batchserve.entrypoints.openai.launch import serve
    from tests.server.fakes import fake_engine
    async_engine = AsyncLLMEngine(fake_engine(delay_s=0.05))
    sys.exit(serve(build_app(async_engine), async_engine, port=int(sys.argv[1]), log_level="warning"))
    """
)


def test_sigterm_drains_in_flight_requests():
    with server_process(SERVE_SCRIPT) as (proc, url):
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "a", "max_tokens": 30, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]"
        assert sum(len(e["choices"][0]["text"]) for e in events[:-1] if e["choices"]) == 30
        assert proc.wait(30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")


def test_serve_flags_and_config_file(tmp_path):
    from batchserve.entrypoints.engine_args import engine_config_from_args
    from batchserve.entrypoints.openai.launch import make_parser

    config_file = tmp_path / "engine.json"
    config_file.write_text(json.dumps({"max_num_seqs": 12, "num_kv_blocks": 300, "truncation": "left"}))
    args = make_parser().parse_args(
        ["some/model.gguf", "--port", "9001", "--api-key", "k", "--max-batch-size", "8", "--config", str(config_file)]
    )
    assert (args.model, args.host, args.port, args.api_key) == ("some/model.gguf", "127.0.0.1", 9001, "k")
    config = engine_config_from_args(args, model=args.model)
    assert config.model == "some/model.gguf" and config.scheduler.max_batch_size == 8  # the flag beats the file
    assert config.cache.num_kv_blocks == 300 and config.scheduler.truncation == "left"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--max-batch-size", "lots"])
