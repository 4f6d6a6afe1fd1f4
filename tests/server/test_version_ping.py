"""vLLM's /version and /ping, on the model-free engine."""

from __future__ import annotations

import httpx
import pytest

import batchserve
from tests.server.fakes import fake_engine
from tests.server.live import start_server


@pytest.fixture(scope="module")
def server():
    live = start_server(fake_engine(), served_model_name=["fake"])
    yield live
    live.stop()


def test_version(server):
    reply = httpx.get(server.url + "/version", timeout=10)
    assert reply.status_code == 200 and reply.json() == {"version": batchserve.__version__}


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health(server, method):
    reply = httpx.request(method, server.url + "/ping", timeout=10)
    health = httpx.get(server.url + "/health", timeout=10)
    assert reply.status_code == health.status_code == 200 and reply.json() == health.json()
