"""Endpoints of other servers that this one lacks answer what they are and what to use instead; real routes win."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from batchserve.entrypoints.openai.app import build_app
from batchserve.entrypoints.openai.unsupported import UNSUPPORTED_ENDPOINTS, unsupported_endpoint
from tests.lazy import openai
from tests.server.fakes import fake_engine
from tests.server.live import start_server

# what the issue named, by the path a vLLM, llama.cpp or OpenAI-client user would call
NAMED = ["/completion", "/props", "/slots", "/embedding"]
# named too, and served now
BUILT = ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/v1/score",
         "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    live = start_server(fake_engine(), served_model_name=["fake"])
    yield live
    live.stop()


@pytest.fixture(scope="module")
def routes() -> list:
    return build_app(fake_engine()).routes


@pytest.fixture(scope="module")
def app_routes(routes) -> set[str]:
    return {route.path for route in routes}


def test_every_named_endpoint_is_in_the_table_or_served(app_routes):
    for path in NAMED:
        assert unsupported_endpoint(path) is not None, path
    for path in BUILT:
        assert unsupported_endpoint(path) is None and path in app_routes, path


@pytest.mark.parametrize("entry", UNSUPPORTED_ENDPOINTS, ids=lambda e: e.path)
def test_each_missing_endpoint_says_what_it_is_and_what_to_use(server, routes, entry):
    path = entry.path.replace("{id}", "abc")
    if any(route.path_regex.fullmatch(path) for route in routes):
        pytest.skip(f"{entry.path} is served now: delete its line from unsupported.py")
    reply = httpx.post(server.url + path, json={"model": "fake"}, timeout=10)
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["code"] == "unsupported_endpoint" and error["type"] == "not_found_error"
    assert error["message"].startswith(f"POST {path} is {entry.origin}'s ") and entry.instead in error["message"]


def test_the_table_names_only_routes_that_exist(app_routes):
    """Every route an answer sends the client to is one this server has."""
    for entry in UNSUPPORTED_ENDPOINTS:
        for route in {word.strip(",;:()") for word in entry.instead.split() if word.startswith("/")}:
            assert route in app_routes or route.startswith("/dashboard"), (entry.path, route)


def test_other_paths_keep_the_plain_not_found(server):
    reply = httpx.get(server.url + "/v1/nothing-here", timeout=10)
    assert reply.status_code == 404 and reply.json()["error"]["code"] is None


def test_the_openai_client_gets_the_answer(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="moderation endpoint, which this server does not have"):
        client.moderations.create(model="fake", input="hello")


def test_a_real_route_wins_over_the_table_whenever_it_is_registered():
    """A route built later for a listed path (here /v1/classify, added after the app is complete) is served."""
    app = build_app(fake_engine())

    @app.post("/v1/classify")
    async def classify() -> dict:
        return {"object": "list", "data": []}

    web = TestClient(app)
    assert web.post("/v1/classify", json={}).json() == {"object": "list", "data": []}
    assert web.post("/classify", json={}).json()["error"]["code"] == "unsupported_endpoint"
    assert web.get("/v1/models").status_code == 200  # the real routes are untouched
    assert web.get("/v1/completions").status_code == 405  # a wrong method on a real route stays 405
