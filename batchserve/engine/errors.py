"""The engine's failures that callers outside it catch (the front ends, Ray replicas, the engine-core client). Kept
apart from the engine's modules, which import torch and the model loader: a process that only classifies errors
(a body-parser child, a front end) need not pay seconds of imports for two class names."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crashed or shut down); no request can be served."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue (max_waiting_requests) is full: retry later."""
