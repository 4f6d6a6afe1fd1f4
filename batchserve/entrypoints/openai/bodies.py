"""Request bodies: JSON checked and validated into the route's pydantic model, and the process that does it for
large bodies.

A large body's parse is tens of milliseconds of one C call (json.loads, then pydantic's validation) that holds the
interpreter lock whole: on a worker thread it still stops the event loop, and every stream's next chunk, for as
long. So bodies over `OFF_LOOP_BODY_BYTES` are parsed in a process of their own (`batchserve serve` starts it), one at a
time, at a lower CPU priority (`PARSER_NICE`): a client looping huge bodies then waits for CPU time the engine core and the event loop
do not want, instead of taking it from them. Small bodies (nearly every request) are parsed on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import multiprocessing
import multiprocessing.context
import os
import pickle
import re
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from batchserve.entrypoints.openai.bounded_fields import refuse_over_bound
from batchserve.entrypoints.openai.errors import APIError, as_api_error, validation_error
from batchserve.entrypoints.openai.refused_bodies import RefusedBodies, body_key
from batchserve.host.heap import start_memory_trace
from batchserve.host.process import name_process
from batchserve.sampling_params import InvalidRequestError

OFF_LOOP_BODY_BYTES = 64 * 1024  # bodies larger than this are parsed in the parser process
PARSER_NICE = 10  # added to the parser process's niceness: it gets a tenth of a core the engine wants
PARENT_CHECK_S = 1.0  # how often the parser process checks that the server is still there

Body = TypeVar("Body", bound=BaseModel)

logger = logging.getLogger(__name__)


def validated_body(body: bytes, model: type[Body], lenient: bool) -> Body:
    """The body as `model`: 400 for malformed JSON or invalid fields. `lenient`: fields the server does not act
    on are dropped with a logged warning instead."""
    data = json_value(body)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        if not lenient:
            raise validation_error(exc) from None
        return _validate_without_unknown_fields(model, data, exc)


def large_body(body: bytes, model: type[Body], lenient: bool) -> Body:
    """`validated_body` for a large body, which a scan of its bytes may refuse first (a bounded list over its bound:
    bounded_fields.py): a few milliseconds a megabyte where the parse would take tens."""
    refuse_over_bound(body, model)
    return validated_body(body, model, lenient)


def json_value(body: bytes) -> object:
    """The body's JSON value; 400 for malformed JSON, NaN or Infinity, nesting past Python's recursion limit, or
    a lone surrogate (\\ud800), which no tokenizer or response could encode."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
        if _MAY_HOLD_SURROGATE.search(body):  # the full check only when the bytes could make one (a cheap scan)
            json.dumps(data, ensure_ascii=False).encode()
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from None
    except UnicodeEncodeError:
        raise APIError(400, "the JSON body holds a lone surrogate (not valid Unicode)", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    return data


# what json.loads can turn into a lone surrogate: a \uD800-\uDFFF escape, UTF-8 bytes of one (it decodes with
# surrogatepass), or a UTF-16/32 body (NUL bytes, which UTF-8 JSON cannot hold)
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\x00")


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number JSON allows")


def _validate_without_unknown_fields(model: type[Body], data: object, exc: ValidationError) -> Body:
    """--lenient: the body without the fields the server would not act on, each named in a warning; any other
    error still answers 400."""
    dropped = []
    for error in exc.errors():
        if error["type"] == "extra_forbidden" and _drop(data, error["loc"]):
            dropped.append(".".join(str(part) for part in error["loc"]))
    if dropped:
        logger.warning("ignoring request field(s) this server does not act on (--lenient): %s", ", ".join(dropped))
    try:
        return model.model_validate(data)
    except ValidationError as again:
        raise validation_error(again) from None


def _drop(data: object, loc: tuple[int | str, ...]) -> bool:
    """Delete the field at `loc` from the JSON value; False when the path does not lead to it (a union's tag)."""
    for part in loc[:-1]:
        try:
            data = data[part]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(data, dict) and loc and loc[-1] in data:
        del data[loc[-1]]
        return True
    return False


# ------------------------------------------------------------------------------------------------ parser process
def _start_parser() -> None:
    """The parser process's set-up: its lower priority if its start did not set it, and an exit of its own when the
    server is gone (killed, it cannot shut the pool down, and an orphan would wait for bodies forever)."""
    name_process("bs-body-parser")
    start_memory_trace("body-parser")
    parent = os.getppid()
    with contextlib.suppress(OSError):  # the server gone already: the watch below exits
        wanted = _lowered(os.getpriority(os.PRIO_PROCESS, parent))
        if os.getpriority(os.PRIO_PROCESS, 0) < wanted:
            os.setpriority(os.PRIO_PROCESS, 0, wanted)
    threading.Thread(target=_exit_with, args=(parent,), name="batchserve-parser-watch", daemon=True).start()


def _lowered(niceness: int) -> int:
    return min(19, niceness + PARSER_NICE)


class _NicedProcess(multiprocessing.context.SpawnProcess):
    """A spawned process whose priority its parent lowers as soon as it exists: its start (a new interpreter
    importing pydantic, FastAPI and the request models: a quarter to most of a second of CPU) runs before any
    initializer of its own could, and at the server's priority it took a core from the engine core."""

    def start(self) -> None:
        super().start()
        with contextlib.suppress(OSError):  # it died at once: the pool reports that
            os.setpriority(os.PRIO_PROCESS, self.pid, _lowered(os.getpriority(os.PRIO_PROCESS, 0)))


class NicedSpawnContext(multiprocessing.context.SpawnContext):
    Process = _NicedProcess


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def _parse_in_parser(body: bytes, model: type[Body], lenient: bool) -> tuple[str, Any]:
    """Runs in the parser process: the body validated, and the checks its model asks to run off the event loop.
    A refusal travels as its APIError's fields (exceptions with keyword-only state do not round-trip through
    pickle)."""
    try:
        parsed = large_body(body, model, lenient)
        check = getattr(parsed, "check_off_loop", None)  # a large constraint's checks, say
        if check is not None:
            check()
        return "ok", parsed
    except (APIError, InvalidRequestError) as exc:
        error = as_api_error(exc)
        return "error", (error.status, error.message, error.type, error.param, error.code, error.headers)


def _warm() -> int:
    return os.getpid()


class BodyParser:
    """Parses large bodies in one child process once `start` has been called and that process is up (it imports
    the request models: seconds); until then, or if it cannot be used (it died, a model does not pickle), on a
    thread, as an app built without `start` (the tests' servers) always does. A body refused before is refused
    again without a parse (refused_bodies.py), and so is one whose bounded list is over its bound in a scan of its
    bytes (bounded_fields.py)."""

    def __init__(self) -> None:
        self.refused = RefusedBodies()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._ready: concurrent.futures.Future | None = None
        self._fallback = asyncio.Semaphore(1)  # threads parsing at once would each hold the lock in turn
        self._on_first_body = False

    def start_on_first_body(self) -> None:
        """Spawn the parser process when the first large body comes (that body is parsed on a thread meanwhile):
        a server that never sees one never pays for the process (its imports: seconds of CPU at every start)."""
        self._on_first_body = True

    def start(self) -> concurrent.futures.Future:
        """Spawn the parser process; the future is done once it can take bodies."""
        if self._pool is None:
            context = NicedSpawnContext()  # spawned: no threads or locks of this process inherited
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=context, initializer=_start_parser)
            self._ready = self._pool.submit(_warm)
        assert self._ready is not None
        return self._ready

    @property
    def in_process(self) -> bool:
        """Whether the next large body goes to the parser process."""
        ready = self._ready
        return ready is not None and ready.done() and ready.exception() is None

    async def parse(self, body: bytes, model: type[Body], lenient: bool) -> Body:
        key = await body_key(body, model, lenient)
        known = self.refused.refusal(key)
        if known is not None:
            raise known
        try:
            return await self._parse(body, model, lenient)
        except APIError as refused:
            self.refused.remember(key, refused)
            raise

    async def _parse(self, body: bytes, model: type[Body], lenient: bool) -> Body:
        if self._pool is None and self._on_first_body:
            self.start()
        if self._pool is None or not self.in_process:
            return await self._on_thread(body, model, lenient)
        try:
            status, value = await asyncio.wrap_future(self._pool.submit(_parse_in_parser, body, model, lenient))
        except (BrokenProcessPool, pickle.PickleError, TypeError, AttributeError, ImportError) as exc:
            # a model or a result that does not pickle surfaces as one of these; a parser process that died is
            # started again for the bodies after this one
            logger.warning("the body parser process failed (%r); parsing this body on a thread", exc)
            self.close()
            self.start()
            return await self._on_thread(body, model, lenient)
        if status == "error":
            raise APIError(*value)
        return value

    async def _on_thread(self, body: bytes, model: type[Body], lenient: bool) -> Body:
        async with self._fallback:
            return await asyncio.to_thread(large_body, body, model, lenient)

    def close(self) -> None:
        pool, self._pool, self._ready = self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
