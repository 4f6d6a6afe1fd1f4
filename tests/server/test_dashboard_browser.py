"""A real browser on /dashboard: headless Chromium (Debian's package) opens the page against a live server under
load, a screenshot goes to bench_results/dashboard.png; once the load has ended it dumps the DOM, whose numbers
must agree with /metrics. Skipped where no chromium is installed (apt-get install -y chromium)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from tests.server.fakes import fake_engine
from tests.server.live import start_server

BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)),
               None)  # fmt: skip
SCREENSHOT = Path(__file__).resolve().parents[2] / "bench_results" / "dashboard.png"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars"]  # fmt: skip

pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium (apt-get install -y chromium)")


def browse(url: str, profile: Path, *extra: str, budget_ms: int = 4000) -> str:
    """Chromium loads `url`, runs its scripts for `budget_ms` of virtual time (which stands still while a fetch is
    in flight, so every poll gets its answer), then does `extra` (dump the DOM, take a screenshot)."""
    command = [BROWSER, *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *extra, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class _Texts(HTMLParser):
    """id -> (text, attributes) of every element with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, tuple[str, dict[str, str | None]]] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self._open.append(found.get("id"))
        if found.get("id"):
            self.by_id[found["id"]] = ("", found)

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for element_id in self._open:
            if element_id:
                text, attrs = self.by_id[element_id]
                self.by_id[element_id] = (text + data, attrs)


def _bucket_of_median(metrics_text: str, name: str) -> tuple[float, float]:
    """The histogram bucket (lower, upper bound) holding the 50th percentile of `name`."""
    buckets = [
        (float(le), float(v)) for le, v in re.findall(rf'{name}_bucket{{le="([^"]+)",[^}}]*}} (\S+)', metrics_text)
    ]
    buckets += [
        (float(le), float(v)) for le, v in re.findall(rf'{name}_bucket{{[^}}]*le="([^"]+)"}} (\S+)', metrics_text)
    ]
    buckets.sort()
    total = buckets[-1][1]
    lower = 0.0
    for upper, count in buckets:
        if count >= total / 2:
            return lower, upper
        lower = upper
    return lower, math.inf


def test_the_page_in_a_browser_agrees_with_metrics(tmp_path):
    server = start_server(fake_engine(delay_s=0.004, max_batch_size=4, max_num_tokens=48, num_kv_blocks=12))
    try:

        def one(i: int) -> None:
            body = {"prompt": "q" * (10 + i % 40), "max_tokens": 16, "ignore_eos": True}
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200

        pool = ThreadPoolExecutor(8)
        load = threading.Thread(target=lambda: list(pool.map(one, range(120))))
        load.start()
        SCREENSHOT.parent.mkdir(exist_ok=True)
        browse(server.url + "/dashboard", tmp_path / "shot", f"--screenshot={SCREENSHOT}", "--window-size=1280,1100")
        load.join(120)
        server.wait_idle()
        dom = browse(server.url + "/dashboard", tmp_path / "dom", "--dump-dom", budget_ms=2500)
        metrics_text = httpx.get(server.url + "/metrics", timeout=10).text
        metrics = server.metrics()
    finally:
        server.stop()
    assert SCREENSHOT.stat().st_size > 10_000
    parser = _Texts()
    parser.feed(dom)
    text = {k: v[0].strip() for k, v in parser.by_id.items()}
    assert int(text["requests-finished"]) == metrics["batchserve:request_success_total"] == 120
    assert int(text["preemptions"]) == metrics["batchserve:num_preemptions_total"]
    assert int(text["waiting"]) == metrics["batchserve:num_requests_waiting"] == 0
    assert int(text["running"]) == metrics["batchserve:num_requests_running"] == 0
    assert (int(text["max-num-tokens"]), int(text["max-batch-size"])) == (48, 4)
    assert float(text["kv-usage"].rstrip("%")) == pytest.approx(100 * metrics["batchserve:kv_cache_usage_perc"])
    assert int(text["strip-len"]) == 300  # the strip is full: more steps than it draws
    for cell, histogram in (("ttft-p50", "batchserve:time_to_first_token_seconds"),
                            ("e2e-p50", "batchserve:e2e_request_latency_seconds")):  # fmt: skip
        seconds = float(parser.by_id[cell][1]["data-seconds"])
        lower, upper = _bucket_of_median(metrics_text, histogram)
        assert lower <= seconds <= upper, (cell, seconds, lower, upper)
    assert "max_batch_size" in dom and "4" in text["max-batch-size"]
