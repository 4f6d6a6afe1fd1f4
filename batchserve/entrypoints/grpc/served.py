"""What both gRPC services (and the KServe HTTP routes) report about the server: the served model names, the
request size limit, the version and when it started."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import metadata

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # as the HTTP server's --max-body-bytes


def package_version() -> str:
    try:
        return metadata.version("batchserve")
    except metadata.PackageNotFoundError:  # a plain checkout on sys.path
        return "0+unknown"


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...]  # the first is the one reported
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    version: str = field(default_factory=package_version)
    started_at: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.names[0]

    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at
