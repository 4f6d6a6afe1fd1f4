"""Fixtures of the server tests."""

from __future__ import annotations

import pytest

from tests.server.live import start_server


@pytest.fixture(scope="session")
def real_server():
    """SmolLM2-135M-Instruct (the default model) with small settings; loading it takes ~30 s on 2 cores."""
    from batchserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_options(num_kv_blocks=512, max_batch_size=32, dtype="float32", max_model_len=512)
    server = start_server(engine, max_body_bytes=256 * 1024)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(real_server):
    """The official openai client on the real server (a test module may define its own `client`)."""
    import openai

    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)
