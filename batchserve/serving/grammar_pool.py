"""Compiling a request's output constraint off the serving process: in a child process, so a compile that overruns
its time is killed with the process (a thread cannot be stopped: a runaway compile would hold a core for as long as
it takes, and keep the server from exiting). The child stays warm between compiles and is replaced after a kill.

The child is never forked from the server itself (a fork of a server with an event loop, tokenizer and OpenMP threads
could inherit a lock held by one of them): it forks from batchserve's forkserver, which imported xgrammar once, or is
spawned (host/children.py); its start is not counted against a request's compile time."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from batchserve.host.children import adopt_launcher, child_context
from batchserve.host.heap import start_memory_trace
from batchserve.host.process import name_process
from batchserve.sampling_params import ConstraintKind, InvalidRequestError, StructuredOutputsParams
from batchserve.serving.errors import ErrorKind, ServingError

logger = logging.getLogger(__name__)

CHILD_START_TIMEOUT_S = 300.0  # importing xgrammar (torch, transformers) on a loaded host
# what the compile of one constraint may take, and how long a request waits for the compiler to be free
COMPILE_TIMEOUT_S = 10.0
# a larger schema, regex or grammar is refused before anything parses it: compile time grows with it
MAX_CONSTRAINT_BYTES = 256 * 1024
# constraints known to compile: repeated ones (a client's fixed schema) skip the child; bounded by their text's size
KNOWN_GOOD_CACHE_BYTES = 16 * 1024 * 1024


@dataclass
class _Child:
    process: multiprocessing.process.BaseProcess
    conn: Connection

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class ConstraintCache:
    """An LRU set of constraint keys, bounded by the bytes of their text."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.size_bytes = 0
        self._keys: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[str, str]) -> bool:
        with self._lock:
            if key not in self._keys:
                return False
            self._keys.move_to_end(key)
            return True

    def add(self, key: tuple[str, str]) -> None:
        size = len(key[1]) + 64
        with self._lock:
            if key in self._keys or size > self.limit_bytes:
                return
            self._keys[key] = size
            self.size_bytes += size
            while self.size_bytes > self.limit_bytes:
                _, dropped = self._keys.popitem(last=False)
                self.size_bytes -= dropped


class GrammarCompilePool:
    """Checks that a constraint compiles over a tokenizer's vocabulary, in a child process, within `timeout_s`.
    One compile at a time (the engine's cores are the model's); a request that cannot get the compiler within
    `timeout_s` is answered 503, one whose compile overruns 400, and its child is killed."""

    def __init__(
        self,
        tokenizer_info_json: str,
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_constraint_bytes: int = MAX_CONSTRAINT_BYTES,
        cache_bytes: int = KNOWN_GOOD_CACHE_BYTES,
    ) -> None:
        self.tokenizer_info_json = tokenizer_info_json
        self.timeout_s = timeout_s
        self.max_constraint_bytes = max_constraint_bytes
        self.known_good = ConstraintCache(cache_bytes)
        self._child: _Child | None = None
        self._busy = threading.Lock()
        self._closed = False

    @property
    def child_pid(self) -> int | None:
        return self._child.process.pid if self._child is not None else None

    def check(self, constraint: StructuredOutputsParams) -> None:
        """Returns once the constraint compiles; InvalidRequestError (too large, invalid, or over its time)."""
        if len(constraint.spec) > self.max_constraint_bytes:  # characters >= a quarter of the bytes: cheap first
            raise too_large(constraint, len(constraint.spec), self.max_constraint_bytes)
        size = len(constraint.spec.encode("utf-8", "surrogatepass"))
        if size > self.max_constraint_bytes:
            raise too_large(constraint, size, self.max_constraint_bytes)
        if constraint.cache_key in self.known_good:
            return
        if not self._busy.acquire(timeout=self.timeout_s):
            raise ServingError(
                ErrorKind.OVERLOADED, "the grammar compiler is busy with other requests, retry later", constraint.source
            )
        try:
            self._compile(constraint)
        finally:
            self._busy.release()
        self.known_good.add(constraint.cache_key)

    def _compile(self, constraint: StructuredOutputsParams) -> None:
        child = self._started()
        child.conn.send((constraint.kind.value, constraint.spec, constraint.source))
        started = time.monotonic()
        if not child.conn.poll(self.timeout_s):
            self._kill_child()
            logger.warning("a %s constraint took over %g s to compile: its compile was killed",
                           constraint.kind.value, self.timeout_s)  # fmt: skip
            raise InvalidRequestError(
                f"{constraint.source}: the {constraint.kind.value} took over {self.timeout_s:g} s to compile",
                constraint.source,
            )
        try:
            outcome, message = child.conn.recv()
        except (EOFError, OSError):  # the child died (out of memory, a crash in the compiler) or was stopped
            self._kill_child()
            if self._closed:
                raise ServingError(ErrorKind.UNAVAILABLE, "the server is shutting down") from None
            raise InvalidRequestError(
                f"{constraint.source}: the {constraint.kind.value} could not be compiled (the compiler died after "
                f"{time.monotonic() - started:.1f} s)",
                constraint.source,
            ) from None
        if outcome != "ok":
            raise InvalidRequestError(message, constraint.source)

    def _started(self) -> _Child:
        if self._closed:
            raise ServingError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        if self._child is not None and self._child.process.is_alive():
            return self._child
        context = child_context()
        parent_conn, child_conn = context.Pipe()
        args = (child_conn, self.tokenizer_info_json, dict(os.environ))
        process = context.Process(target=serve_compiles, args=args, name="batchserve-grammar", daemon=True)
        process.start()
        child_conn.close()
        child = self._child = _Child(process, parent_conn)  # registered now: close() kills a child still starting
        try:
            if not parent_conn.poll(CHILD_START_TIMEOUT_S):
                raise EOFError
            parent_conn.recv()  # "ready"
        except (EOFError, OSError):
            self._kill_child()
            raise ServingError(ErrorKind.UNAVAILABLE, "the grammar compiler did not start") from None
        return child

    def _kill_child(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()

    def close(self) -> None:
        """Stop the child (a compile in progress is killed); later checks are refused."""
        self._closed = True
        self._kill_child()


def too_large(constraint: StructuredOutputsParams, size: int, limit: int = MAX_CONSTRAINT_BYTES) -> InvalidRequestError:
    """The refusal of a constraint of `size` bytes, over `limit`."""
    return InvalidRequestError(
        f"{constraint.source}: the {constraint.kind.value} is {size} bytes, more than the {limit} a constraint may be",
        constraint.source,
    )


def serve_compiles(conn: Connection, tokenizer_info_json: str, environ: dict[str, str]) -> None:
    """The child: compiles each (kind, spec, source) it is sent and answers ("ok", "") or ("invalid", message).
    It ends when the server closes its end (or dies: the socket's EOF)."""
    adopt_launcher(environ)  # the JSON grammar's digit bounds are read from the environment (env.py)
    name_process("bs-grammar")  # before the imports (seconds): a soak sampling meanwhile sees its role
    start_memory_trace("grammar")
    import xgrammar as xgr

    from batchserve.worker.structured_output import compile_constraint

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the parent remembers what compiled
    conn.send("ready")
    while True:
        try:
            kind, spec, source = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compile_constraint(compiler, StructuredOutputsParams(ConstraintKind(kind), spec, source))
            conn.send(("ok", ""))
        except InvalidRequestError as exc:
            conn.send(("invalid", str(exc)))
        except Exception as exc:  # noqa: BLE001 - the parent answers it as a constraint that does not compile
            conn.send(("invalid", f"{source}: invalid {kind}: {type(exc).__name__}: {exc}"))


def tokenizer_info_json(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> str:
    """The vocabulary as xgrammar reads it, serialized for the child."""
    from batchserve.worker.structured_output import tokenizer_info

    return tokenizer_info(tokenizer, vocab_size, eos_token_ids).serialize_json()
