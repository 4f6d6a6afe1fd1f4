"""The dashboard's disk-tier panel on a live server over a real (tiny, random) Llama with the tier on: its counts
agree with /metrics after a prefix is written, evicted and read back, and headless Chromium draws them (skipped
without chromium); a server without a tier has no panel."""

from __future__ import annotations

import httpx
import pytest

from batchserve.engine.llm_engine import LLMEngine
from tests.server.fakes import fake_engine
from tests.server.live import start_server
from tests.server.test_dashboard_browser import BROWSER, _Texts, browse
from tests.tiny_models import VOCAB, hf_greedy, tiny_checkpoint

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "llama", "tiny_llama_tier_panel")


def complete(url: str, prompt: list[int], max_tokens: int = 4) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return [int(word[1:]) for word in reply.json()["choices"][0]["text"].split()]  # the word-level tokenizer's text


def test_the_tier_panel_agrees_with_metrics(tiny, tmp_path):
    model, directory = tiny
    engine = LLMEngine.from_options(model=str(directory), device="cpu", dtype="float32", block_size=BLOCK,
                                    num_kv_blocks=12, kv_offload_dir=str(tmp_path), kv_offload_max_bytes=10**8)  # fmt: skip
    server = start_server(engine)
    try:
        prompt = [(7 * i) % (VOCAB - 3) + 3 for i in range(5 * BLOCK + 3)]
        first = complete(server.url, prompt)
        engine.runner.offload.flush()
        complete(server.url, [(11 * i) % (VOCAB - 3) + 3 for i in range(12 * BLOCK - 8)], 1)  # evicts the prompt
        engine.runner.offload.flush()
        assert complete(server.url, prompt) == first == hf_greedy(model, prompt, 4)
        server.wait_idle()
        engine.runner.offload.flush()
        tier = httpx.get(server.url + "/dashboard/data", timeout=10).json()["kv_tier"]
        metrics = server.metrics()
        assert (
            tier["hit_blocks"] == 5
            and tier["hit_tokens"] == 5 * BLOCK == metrics["batchserve:kv_tier_hit_tokens_total"]
        )
        assert tier["written_blocks"] == metrics["batchserve:kv_tier_written_blocks_total"] >= 5 + 11
        assert tier["bytes_used"] == metrics["batchserve:kv_tier_bytes_used"] > 0 and tier["max_bytes"] == 10**8
        assert tier["blocks_read"] >= 5 and tier["read_s"] > 0
        assert tier["loading_requests"] == metrics["batchserve:kv_tier_loading_requests"] == 0
        assert tier["corrupt_dropped"] == tier["write_errors"] == tier["saves_skipped"] == 0
        page = httpx.get(server.url + "/dashboard", timeout=10).text
        assert 'id="kv-tier"' in page and "renderTier(d.kv_tier)" in page
        if BROWSER is not None:  # the page as a browser draws it
            texts = _Texts()
            texts.feed(browse(server.url + "/dashboard", tmp_path / "profile", "--dump-dom"))
            panel = texts.by_id
            assert "hidden" not in panel["kv-tier"][1]
            assert panel["tier-hits"][0] == f"5 ({5 * BLOCK})" and panel["tier-loading"][0] == "0"
            assert panel["tier-written"][0].startswith(f"{tier['written_blocks']}, ")
            assert panel["tier-trouble"][0] == "0 / 0 / 0"
    finally:
        server.stop()
        engine.close()


def test_no_panel_without_a_tier():
    server = start_server(fake_engine(delay_s=0.001))
    try:
        assert "kv_tier" not in httpx.get(server.url + "/dashboard/data", timeout=10).json()
    finally:
        server.stop()
