"""The dashboard: ?replica= is honoured (an unknown id is a 404, never another replica's data), and the token chart
draws decode-only steps (a few tokens against a budget of thousands) visibly."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from batchserve.entrypoints.openai.dashboard import dashboard_html
from batchserve.serving.live_stats import LiveStats, RequestPoint, latency_summary
from tests.server.fakes import fake_engine
from tests.server.live import start_server


@pytest.fixture(scope="module")
def server():
    live = start_server(fake_engine(), served_model_name=["fake"])
    yield live
    live.stop()


def test_an_unknown_replica_id_is_a_404(server):
    reply = httpx.get(server.url + "/dashboard/data", params={"replica": "7"}, timeout=10)
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "replica"
    assert "no replica '7'" in reply.json()["error"]["message"]
    assert httpx.get(server.url + "/dashboard/data", timeout=10).status_code == 200


def test_the_ray_ingress_refuses_an_unknown_replica_instead_of_showing_another(monkeypatch):
    from batchserve.distributed import dashboard as ray_dashboard

    report = LiveStats().snapshot()
    monkeypatch.setattr(ray_dashboard, "routers_replica_stats",
                        lambda routers: {"a": {ray_dashboard.DASHBOARD_KEY: report,
                                               ray_dashboard.REPORTED_AT_KEY: 1e18}})  # fmt: skip
    source = ray_dashboard.ReplicaDashboards([])
    assert source.snapshot(replica="a")["replica"] == "a" and source.snapshot()["replica"] == "a"
    with pytest.raises(LookupError, match="no replica 'b'"):
        source.snapshot(replica="b")


def test_the_page_takes_the_replica_from_its_url():
    page = dashboard_html()
    assert 'new URLSearchParams(location.search).get("replica")' in page
    assert 'url.searchParams.set("replica", id)' in page  # a picked replica goes back into the URL


@pytest.mark.skipif(shutil.which("node") is None, reason="no node to run the page's chart functions")
def test_decode_only_steps_are_drawn_at_least_a_pixel_high():
    script = re.search(r"<script>(.*)</script>", dashboard_html(), re.S).group(1)
    functions = "\n".join(re.search(rf"function {name}\(.*?\n}}\n", script, re.S).group(0)
                          for name in ("tokenAxis", "barHeight"))  # fmt: skip
    f = {"prefill_tokens": 0, "decode_tokens": 1}
    decode_only = [[0, 4], [0, 6], [0, 5]]  # a few sequences decoding, max_num_tokens 2048
    busy = decode_only + [[1900, 3]]
    probe = (
        f"{functions}\nconst f = {json.dumps(f)};\n"
        f"const axis = tokenAxis({json.dumps(decode_only)}, f, 2048);\n"
        f"const busyAxis = tokenAxis({json.dumps(busy)}, f, 2048);\n"
        "console.log(JSON.stringify({axis, busyAxis, bar: barHeight(4, 60 / axis), raw: barHeight(4, 60 / 2048),"
        " none: barHeight(0, 1)}));"
    )
    out = subprocess.run(["node", "-e", probe], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent)
    result = json.loads(out.stdout)
    assert result["axis"] == 6 and result["busyAxis"] == 2048  # the budget stays the axis while a step nears it
    assert result["bar"] >= 30 and result["raw"] >= 1 and result["none"] == 0


def test_the_adapter_table_is_filled_from_the_per_adapter_latencies():
    page = dashboard_html()
    assert '<table id="adapters" hidden>' in page and "renderAdapters(d.latency.by_adapter || {})" in page
    base_only = latency_summary([_request_point(None, 0.1)], 60.0)
    assert "by_adapter" not in base_only  # no adapter ran: the table stays hidden
    summary = latency_summary([_request_point(None, 0.1), _request_point("sql", 0.2), _request_point("sql", 0.4)], 60.0)
    assert summary["by_adapter"]["sql"]["count"] == 2 and summary["by_adapter"][""]["count"] == 1
    assert summary["by_adapter"]["sql"]["tpot_s"]["p50"] == pytest.approx(0.3)


def _request_point(adapter, tpot_s: float) -> RequestPoint:
    return RequestPoint("r", 0.0, 1.0, 3, 4, 0, 0, "length", 0.0, 0.05, tpot_s, 1.0, adapter=adapter)
