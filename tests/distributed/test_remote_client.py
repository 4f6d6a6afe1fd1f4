"""RemoteEngineClient's calls to the replicas, seen from a stand-in deployment handle (no Ray cluster): each call
must reach Ray Serve as a call of its own, never under the Serve request context of the request being served."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from batchserve.distributed.messages import Admitted
from batchserve.request import EngineRequest
from batchserve.sampling_params import SamplingParams
from tests.lazy import LazyModule

# the client imports Ray Serve: imported by the tests that run it, not by every worker that collects this file
client_module = LazyModule("batchserve.distributed.client")


class _Method:
    def __init__(self, name: str, seen: list[tuple[str, str]], first: object | None) -> None:
        self.name, self.seen, self.first = name, seen, first

    def remote(self, argument: object):
        from ray.serve.context import _get_serve_request_context

        # what Ray Serve's handle reads to name the call (ray.serve._private.default_impl.get_request_metadata)
        self.seen.append((self.name, _get_serve_request_context()._internal_request_id))
        return self._stream()

    async def _stream(self):
        if self.first is not None:
            yield self.first
        await asyncio.Event().wait()  # open until cancelled, as a request's call stays open while it runs


class _Handle:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.generate = _Method("generate", self.seen, Admitted("replica-a"))
        self.subscribe = _Method("subscribe", self.seen, None)

    def options(self, **_: object) -> _Handle:
        return self


def test_every_call_to_a_replica_is_its_own_serve_request():
    """The n choices of one HTTP request are placed from that request's task, and the subscription is started from
    it: had they carried its Serve context, they would share its internal id, which Serve's router keys calls by
    (calls pending together under one id: all but one stay unrouted)."""

    from ray.serve.context import _RequestContext, _serve_request_context

    async def serve_one_http_request() -> list[tuple[str, str]]:
        handle = _Handle()
        client = client_module.RemoteEngineClient(handle, description=None, tokenizer=None)  # type: ignore[arg-type]
        _serve_request_context.set(_RequestContext(request_id="http-1", _internal_request_id="http-1"))
        for child in range(3):
            await client.add_request(EngineRequest(f"http-1-{child}", [1, 2, 3], SamplingParams(max_tokens=4)))
        await asyncio.sleep(0)  # the subscription task starts
        await client.close()
        return handle.seen

    seen = asyncio.run(serve_one_http_request())
    assert [name for name, _ in seen] == ["generate", "generate", "generate", "subscribe"]
    assert all(internal_id == "" for _, internal_id in seen), seen  # "": Serve gives each call a fresh id


def test_the_ingress_serves_the_replicas_adapters_by_model_name():
    """The ingress answers /v1/models and the `model` check from what the replicas described: their adapters are
    listed with the base as parent, and an unknown name is a 404 naming them."""
    from fastapi.testclient import TestClient

    from batchserve.config import EngineConfig, Truncation
    from batchserve.distributed.messages import EngineDescription
    from batchserve.engine.inputs import EngineLimits
    from batchserve.entrypoints.openai.app import build_front_app
    from batchserve.request import LoRARequest

    config = EngineConfig(model="tiny-base", enable_lora=True, lora_modules="sql=/adapters/sql")
    limits = EngineLimits(64, 64, 100, Truncation.ERROR, 1024)
    loras = (LoRARequest("sql", 1, "/adapters/sql"),)
    client = client_module.RemoteEngineClient(
        _Handle(), EngineDescription(config, limits, 64, {}, loras), tokenizer=None
    )
    assert client.lora_names() == ("sql",) and client.list_loras() == list(loras)
    app = build_front_app(
        client, ["tiny-base"], api_key=None, max_body_bytes=1 << 20, lenient=False,
        render_metrics=lambda: b"", health_problem=lambda: None,
    )  # fmt: skip
    with TestClient(app) as http:
        cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        assert cards["sql"]["parent"] == "tiny-base" and cards["sql"]["root"] == "/adapters/sql"
        missing = http.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 2})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "'sql'" in missing.json()["error"]["message"]


def test_the_ingress_delays_repeat_offenders_on_its_own_http_port(monkeypatch):
    """The ingress keeps serve's offender table (--error-delay-*): its app's 4xx and its protocol's 413 count
    against one client and wait, and /metrics shows the table."""
    import httpx

    from batchserve.config import EngineConfig, Truncation
    from batchserve.distributed.ingress import OpenAIIngress
    from batchserve.distributed.messages import EngineDescription
    from batchserve.distributed.options import RayAppOptions
    from batchserve.engine.inputs import EngineLimits
    from batchserve.serving.metrics import parse_metrics

    description = EngineDescription(EngineConfig(model="tiny-base"), EngineLimits(64, 64, 100, Truncation.ERROR, 1024),
                                    64, {}, ())  # fmt: skip
    client = client_module.RemoteEngineClient(_Handle(), description, tokenizer=None)

    async def connect(cls, handle):
        return client

    monkeypatch.setattr(client_module.RemoteEngineClient, "connect", classmethod(connect))
    monkeypatch.setattr("batchserve.distributed.ingress.replica_metrics", lambda: {})  # no Ray cluster here
    options = RayAppOptions(http_port=0, max_body_bytes=1000, error_delay_max_s=0.05, error_delay_after=1)

    async def offend() -> tuple[list[int], dict[str, float], OpenAIIngress]:
        ingress = OpenAIIngress.__new__(OpenAIIngress)
        await ingress.__init__(None, options)  # Ray Serve awaits a deployment's async __init__ so
        port = ingress.http_server.servers[0].sockets[0].getsockname()[1]
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                statuses = [(await http.post("/v1/completions", json={"prompt": 5})).status_code for _ in range(3)]
                statuses.append((await http.post("/v1/completions", content=b"{" * 2000)).status_code)
                metrics = parse_metrics((await http.get("/metrics")).text)
        finally:
            await ingress.drain()
        return statuses, metrics, ingress

    statuses, metrics, ingress = asyncio.run(offend())
    assert statuses == [400, 400, 400, 413]
    assert ingress.offenders.delayed_total == 3  # all but the first (--error-delay-after 1), the 413 among them
    assert metrics["batchserve:error_responses_delayed_total"] == 3 and metrics["batchserve:error_delay_clients"] == 1
    with pytest.raises(ValidationError, match="error_delay_max_s"):
        RayAppOptions(error_delay_max_s=-1)
