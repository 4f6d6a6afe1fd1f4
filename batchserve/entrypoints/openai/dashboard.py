"""GET /dashboard: one self-contained HTML page (no request leaves the server) drawing the engine's live state from
GET /dashboard/data, which it polls once a second: waiting and running, the step strip against the budgets, KV
usage, prefix hits, preemptions, the last minute's latency percentiles and the effective configuration.

The page holds no data, so it is served without the API key (a browser cannot send a bearer token on navigation);
/dashboard/data needs the key when one is set: the page asks for it, or takes it from the URL fragment (#key=...),
which browsers never send to the server.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any, Protocol

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response

PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data"


@functools.cache
def dashboard_html() -> str:
    return resources.files("batchserve.entrypoints.openai").joinpath("static/dashboard.html").read_text("utf-8")


class SnapshotSource(Protocol):
    """LiveStats beside a local engine; the replicas' reports on the Ray ingress (distributed/dashboard.py), which
    also take `replica`. Both raise LookupError for a replica id they do not have."""

    def snapshot(self, since_step: int = -1, with_requests: bool = False, finished_after: float = 0.0,
                 replica: str = "") -> dict[str, Any]: ...  # fmt: skip


def add_dashboard_routes(app: FastAPI, source: SnapshotSource) -> None:
    @app.get(PAGE_PATH, include_in_schema=False)
    async def dashboard() -> Response:
        return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-cache"})

    @app.get(DATA_PATH, include_in_schema=False)
    async def dashboard_data(
        since: int = Query(-1),
        requests: bool = Query(False),
        finished_after: float = Query(0.0),
        replica: str = Query(""),
    ) -> Response:
        """`since`: only the steps after that index; `requests`: each request finished in the last minute (after
        `finished_after`, a wall time) too; `replica`: which engine replica's (Ray app only; an id no replica has
        is a 404, not another replica's data)."""
        try:
            return JSONResponse(source.snapshot(since, requests, finished_after, replica))
        except LookupError as exc:  # an unknown replica id
            error = {"message": str(exc).strip("'\""), "type": "not_found_error", "param": "replica", "code": None}
            return JSONResponse({"error": error}, status_code=404)
