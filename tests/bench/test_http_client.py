import json

import httpx

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.http_client import completion_body, run_http
from batchserve.bench.metrics import summarize
from batchserve.bench.workloads import WorkloadOptions, make_workload


def _sse(chunks):
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_streaming_run_against_a_mock_server(tokenizer):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "mock-model"}]})
        body = json.loads(request.content)
        seen.append(body)
        if body["max_tokens"] == 999:
            return httpx.Response(400, json={"error": "too long"})
        n = body["max_tokens"]
        chunks = [{"choices": [{"text": f" t{i}", "index": 0}]} for i in range(n)]
        chunks.append({"choices": [{"text": "", "finish_reason": "length"}]})
        details = {"prompt_tokens_details": {"cached_tokens": 3}} if body["prompt"] == reqs[0].prompt_token_ids else {}
        chunks.append({"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": n, **details}})
        return httpx.Response(200, text=_sse(chunks), headers={"content-type": "text/event-stream"})

    reqs = make_workload("uniform", tokenizer, 5, options=WorkloadOptions(input_len=6, output_len=4, spread=0))
    reqs[-1].output_len = 999
    trace = run_http(
        "http://mock", reqs, ArrivalProcess(max_concurrency=2), progress=False, transport=httpx.MockTransport(handler)
    )
    assert all(b["model"] == "mock-model" and b["stream"] and b["ignore_eos"] for b in seen)
    assert seen[0]["prompt"] == reqs[0].prompt_token_ids
    ok, bad = trace.requests[:4], trace.requests[4]
    assert all(r.success and r.output_len == 4 and len(r.token_times) == 4 for r in ok)
    assert all(r.arrival_time <= r.first_token_time <= r.finish_time for r in ok)
    assert not bad.success and "400" in bad.error
    assert trace.meta["model"] == "mock-model"
    assert ok[0].num_cached_tokens == 3 and ok[1].num_cached_tokens is None
    summary = summarize(trace.requests, 1.0)
    assert summary["prefix_cache_hit_rate"] == 3 / 24 and "num_preemptions" not in summary  # unknown over HTTP


def test_text_prompt_body(tokenizer):
    req = make_workload("uniform", tokenizer, 1, options=WorkloadOptions(input_len=6))[0]
    body = completion_body(req, "m", "text", tokenizer)
    assert isinstance(body["prompt"], str) and len(tokenizer.encode(body["prompt"])) == 6
