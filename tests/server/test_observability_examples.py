"""examples/observability: every series the Grafana dashboard queries is in /metrics; with Debian's `prometheus`
binary on the PATH, a real Prometheus scrapes a live server and holds every one of them (skipped without it)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server.fakes import fake_engine
from tests.server.live import start_server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "observability"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def queried_series() -> set[str]:
    """Every batchserve series named anywhere in the dashboard (panel queries, template variables)."""
    text = (EXAMPLES / "grafana-dashboard.json").read_text()
    json.loads(text)  # valid JSON
    return set(re.findall(r"batchserve:[A-Za-z0-9_:]+", text))


def exported_series(metrics_text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in metrics_text.splitlines() if line and line[0] != "#"}


@pytest.fixture(scope="module")
def loaded_server():
    server = start_server(fake_engine(num_kv_blocks=8, max_batch_size=8))
    try:
        for i in range(4):  # a few requests, enough to preempt: every labelled series has a value
            body = {"prompt": "p" * (20 + i), "max_tokens": 12, "ignore_eos": True}
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        server.wait_idle()
        yield server
    finally:
        server.stop()


def test_every_series_the_grafana_dashboard_queries_is_exported(loaded_server):
    queried = queried_series()
    assert len(queried) >= 15
    exported = exported_series(httpx.get(loaded_server.url + "/metrics", timeout=10).text)
    missing = sorted(name for name in queried if name not in exported)
    assert missing == [], f"the dashboard queries series /metrics does not have: {missing}"
    for name in queried:
        if name.endswith("_bucket"):
            assert {name.removesuffix("_bucket") + s for s in HISTOGRAM_SUFFIXES} <= exported


def test_the_prometheus_example_scrapes_metrics():
    config = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (apt-get install prometheus)")
def test_a_real_prometheus_scrapes_every_series_the_dashboard_queries(loaded_server, tmp_path):
    port = _free_port()
    target = loaded_server.url.removeprefix("http://")
    config = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [target]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    command = ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'db'}",
               f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        queried, names = queried_series(), set()
        deadline = time.monotonic() + 60
        while not queried <= names and time.monotonic() < deadline:
            time.sleep(0.25)  # the first scrape lands a second or two in: a whole second per poll overshoots it
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/api/v1/label/__name__/values", timeout=5).json()
                names = set(reply.get("data") or [])
            except httpx.TransportError:
                assert proc.poll() is None, "prometheus exited"
        assert sorted(queried - names) == []
        value = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": "batchserve:kv_cache_blocks_total"},
                          timeout=5).json()["data"]["result"]  # fmt: skip
        assert float(value[0]["value"][1]) == 8
    finally:
        proc.terminate()
        proc.wait(30)
