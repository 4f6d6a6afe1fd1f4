"""/dashboard and /dashboard/data on a live server over the fake engine: the page is self-contained, the data
agrees with /metrics, the key guards the data."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.fakes import fake_engine
from tests.server.live import start_server


def _load(url: str, n: int, max_tokens: int = 6, headers: dict[str, str] | None = None) -> None:
    def one(i: int) -> None:
        body = {"prompt": "x" * (10 + i), "max_tokens": max_tokens, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30).status_code == 200

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(n)))


@pytest.fixture()
def server():
    # steps of 5 ms: a request of 12 tokens lasts 60 ms or more, so 8 clients overlap even on a busy host
    server = start_server(fake_engine(delay_s=0.005, max_batch_size=4, max_num_tokens=64))
    yield server
    server.stop()


def test_the_page_makes_no_request_off_the_server(server):
    page = httpx.get(server.url + "/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "dashboard/data" in page.text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text), "an external resource"
    assert not re.search(r"""fetch\(\s*["'](https?:)?//""", page.text)


def test_the_data_agrees_with_metrics(server):
    _load(server.url, 12, max_tokens=12)
    server.wait_idle()
    data = httpx.get(server.url + "/dashboard/data", params={"requests": True}, timeout=10).json()
    metrics = server.metrics()
    assert data["limits"] == {"max_num_tokens": 64, "max_batch_size": 4, "num_kv_blocks": 256}
    assert data["now"]["requests_finished_total"] == metrics["batchserve:request_success_total"] == 12
    assert data["now"]["generation_tokens_total"] == metrics["batchserve:generation_tokens_total"] == 12 * 12
    assert data["now"]["preemptions_total"] == metrics["batchserve:num_preemptions_total"]
    assert data["latency"]["count"] == len(data["requests"]) == 12
    fields = data["step_fields"]
    steps = [dict(zip(fields, s)) for s in data["steps"]]
    assert (
        sum(s["prefill_tokens"] + s["decode_tokens"] for s in steps) == metrics["batchserve:iteration_tokens_total_sum"]
    )
    assert all(s["seqs"] <= 4 and s["prefill_tokens"] + s["decode_tokens"] <= 64 for s in steps)
    assert max(s["waiting"] for s in steps) > 0, "8 clients against max_batch_size 4 must queue"
    ttft = sorted(r["ttft_s"] for r in data["requests"])
    assert ttft[0] <= data["latency"]["ttft_s"]["p50"] <= data["latency"]["ttft_s"]["p99"] <= ttft[-1]
    last = max(r["finished_time"] for r in data["requests"])
    params = {"since": steps[-1]["index"], "requests": True, "finished_after": last}
    later = httpx.get(server.url + "/dashboard/data", params=params, timeout=10).json()
    assert later["steps"] == [] and later["requests"] == []


def test_the_data_needs_the_key_the_page_does_not():
    server = start_server(fake_engine(), api_key="sesame")
    try:
        assert httpx.get(server.url + "/dashboard", timeout=10).status_code == 200
        assert httpx.get(server.url + "/dashboard/data", timeout=10).status_code == 401
        ok = httpx.get(server.url + "/dashboard/data", headers={"Authorization": "Bearer sesame"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["now"]["waiting"] == 0
    finally:
        server.stop()


def test_goodput_of_the_last_minute_agrees_with_metrics(server):
    targets = [{"ttft_slo_ms": 60_000}, {"ttft_slo_ms": 60_000, "tpot_slo_ms": 0.001}, {}]  # met, missed, none
    for extra in targets:
        body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, **extra}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    server.wait_idle()
    slo = httpx.get(server.url + "/dashboard/data", timeout=10).json()["latency"]["slo"]
    assert (slo["with_targets"], slo["met"]) == (2, 1)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'batchserve:request_slo_total{model_name="' in text and 'result="missed"} 1.0' in text
