"""Ray Serve reads its settings when it is first imported, in the driver too (the handles an application is built
with take their transport from there). The environment `batchserve serve --replicas` gives the Ray instance it starts
(launch.LOCAL_RAY_ENVIRONMENT: Serve's throughput-optimized mode among it) is exported here, before a test module
here imports Ray Serve, so the Ray app runs in these tests as it runs for a user; a value exported already stays."""

from __future__ import annotations

import os

from batchserve.distributed.launch import LOCAL_RAY_ENVIRONMENT

for _name, _value in LOCAL_RAY_ENVIRONMENT.items():
    os.environ.setdefault(_name, _value)
