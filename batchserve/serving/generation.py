"""Submitting a front end's request (one or more prompts) to the engine and reading its results back, whatever the
protocol: all-or-nothing admission, results as they arrive or once finished, aborts when the caller goes away."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from batchserve.config import Truncation
from batchserve.engine.async_engine import RequestStream
from batchserve.engine.inputs import EngineLimits, RequestBuilder, check_text
from batchserve.engine.outputs import Completion, CompletionDelta
from batchserve.request import EngineRequest
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from batchserve.serving.chat import chat_prompt_ids
from batchserve.serving.client import EngineClient
from batchserve.serving.decoding import decode_releasing_gil
from batchserve.serving.errors import ErrorKind, ServingError
from batchserve.serving.results import GenerationResult
from batchserve.serving.structured import ConstraintChecker

T = TypeVar("T")

MAX_PROMPTS_PER_REQUEST = 128  # a batch of prompts in one request; more is a bulk job for the offline API


class ClientGone(ServingError):
    """The caller went away before its results were ready; its requests have been aborted."""

    def __init__(self) -> None:
        super().__init__(ErrorKind.CANCELLED, "client disconnected")


class RequestTimedOut(ServingError):
    """A request's deadline passed before it finished; it has been aborted and its KV blocks freed."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(ErrorKind.TIMEOUT, f"the request did not finish within its timeout of {timeout_s:g} s "
                         "(waiting and running): it was ended and its KV blocks freed", "timeout")  # fmt: skip


@dataclass(frozen=True)
class Deadline:
    """When a request must be done (time.monotonic()), and the timeout that set it (for the error's words)."""

    timeout_s: float
    at: float

    def remaining(self) -> float:
        return self.at - time.monotonic()


class GenerationService:
    """One per front end, over one EngineClient."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.tokenizer: PreTrainedTokenizerBase = client.tokenizer  # both fixed for the engine's life
        self.limits: EngineLimits = client.limits
        self.requests = RequestBuilder(self.tokenizer, self.limits)  # the one place a request is checked
        self.constraints = ConstraintChecker(self.tokenizer)  # a structured-output constraint compiles, in time
        self.request_timeout_s: float | None = client.config.scheduler.request_timeout  # --request-timeout
        # each admitted stream's deadline, read while its results are awaited (weak: a stream dropped is forgotten)
        self._deadlines: weakref.WeakKeyDictionary[RequestStream, Deadline] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ inputs
    # Tokenizing a megabyte of text takes seconds: it runs in a worker thread (the Rust tokenizer releases the GIL),
    # never on the event loop that streams everyone's tokens, nor on the engine loop that steps them.

    async def chat_prompt(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        self.check_text_length(sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, Mapping)))
        return await asyncio.to_thread(chat_prompt_ids, self.tokenizer, messages, add_generation_prompt)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_text_length(len(check_text(text)))
        return list(await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: list[int]) -> str:
        return decode_releasing_gil(self.tokenizer, self.limits.check_token_ids(token_ids, "token ids", "tokens"))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def check_text_length(self, num_chars: int) -> None:
        """Refuse, before tokenizing, a text that must hold more tokens than any prompt may: no token is longer
        than the tokenizer's longest, so that bounds the count from below."""
        if self.limits.truncation != Truncation.ERROR:
            return
        fewest_tokens = num_chars // self._longest_token_chars
        if fewest_tokens > self.limits.max_input_len:
            raise InvalidRequestError(
                f"the prompt has at least {fewest_tokens} tokens ({num_chars} characters), more than the "
                f"{self.limits.max_input_len} allowed (max_input_len)",
                "prompt",
            )

    @functools.cached_property
    def _longest_token_chars(self) -> int:
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return max(1, *(len(p) for p in pieces if p))

    async def request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> EngineRequest:
        """The engine request for a prompt (a text tokenized here, off the event loop; token ids as they are),
        checked by the builder."""
        if isinstance(prompt, str):
            token_ids = await self.tokenize(prompt) if prompt else []
            return self.requests.build(request_id, token_ids, params, priority, prompt=prompt)
        return self.requests.build(request_id, prompt, params, priority)

    # ------------------------------------------------------------------ submitting
    def deadline(self, timeout_s: float | None) -> Deadline | None:
        """When a request submitted now must be done: its own `timeout`, else the server's --request-timeout."""
        if timeout_s is None:
            timeout_s = self.request_timeout_s
        if timeout_s is None:
            return None
        if not timeout_s > 0:
            raise InvalidRequestError(f"timeout must be a positive number of seconds, got {timeout_s}", "timeout")
        return Deadline(timeout_s, time.monotonic() + timeout_s)

    async def submit(
        self, base_id: str, prompts: Sequence[str | list[int]], params: SamplingParams, priority: int = 0,
        deadline: Deadline | None = None,
    ) -> list[RequestStream]:  # fmt: skip
        """One request per prompt (ids `base_id`, or `base_id-i` for several), all built and checked before any is
        admitted; then every one admitted, or none."""
        if not prompts:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise InvalidRequestError(
                f"a request may hold at most {MAX_PROMPTS_PER_REQUEST} prompts, got {len(prompts)}", "prompt"
            )
        self.client.check_capacity()  # a full queue is refused before any prompt is tokenized
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        requests = [await self.request(rid, p, params, priority) for rid, p in zip(ids, prompts)]
        return await self.admit(requests, deadline)

    async def admit(self, requests: Sequence[EngineRequest], deadline: Deadline | None = None) -> list[RequestStream]:
        """Every request admitted, or none: a failure aborts those already added and raises. Each output constraint
        compiles (in time) before any request is added: every front end's requests pass here. `deadline`: when
        they must be done (None: the server's --request-timeout from now, if it has one)."""
        deadline = deadline if deadline is not None else self.deadline(None)
        for constraint in {r.sampling_params.structured_outputs for r in requests}:
            await self.constraints.check(constraint)
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(await self.client.add_request(request))
        except BaseException:
            self.abort_unfinished(streams)
            raise
        if deadline is not None:
            for stream in streams:
                self._deadlines[stream] = deadline
        return streams

    def _deadline_of(self, streams: Sequence[RequestStream]) -> Deadline | None:
        deadlines = [d for d in (self._deadlines.get(s) for s in streams) if d is not None]
        return min(deadlines, key=lambda d: d.at) if deadlines else None

    def abort_unfinished(self, streams: Sequence[RequestStream]) -> None:
        self.client.abort([s.request_id for s in streams if not s.finished])

    # ------------------------------------------------------------------ results
    async def final_results(
        self, streams: Sequence[RequestStream], caller_gone: Awaitable[Any] | None = None
    ) -> list[GenerationResult]:
        """Each stream's last result, in prompt order; raises ClientGone (and aborts them all) if `caller_gone`
        completes first."""

        async def last(index: int, stream: RequestStream) -> GenerationResult:
            final, completion = None, Completion.of(stream.request)
            async for out in stream:
                final = _folded(out, completion, index)
            assert final is not None, "a request stream ends with its final output"
            return final

        gathering = asyncio.gather(*(last(i, s) for i, s in enumerate(streams)))
        watching = asyncio.ensure_future(caller_gone) if caller_gone is not None else None
        deadline = self._deadline_of(streams)
        try:
            waited = {gathering} | ({watching} if watching else set())
            done, _ = await asyncio.wait(waited, timeout=deadline and max(0.0, deadline.remaining()),
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if gathering in done:
                return list(gathering.result())
            if watching is not None and watching in done:
                raise ClientGone()
            assert deadline is not None, "only a deadline ends the wait with nothing done"
            raise RequestTimedOut(deadline.timeout_s)
        finally:
            if watching is not None:
                watching.cancel()
            if not gathering.done():
                gathering.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await gathering  # retrieved, so asyncio never logs "exception was never retrieved"
            self.abort_unfinished(streams)

    async def results(self, streams: Sequence[RequestStream]) -> AsyncIterator[GenerationResult]:
        """Every stream's results as they arrive, interleaved; the caller aborts the unfinished ones when it stops.
        Past the streams' deadline they are aborted and RequestTimedOut is raised."""
        completions = [Completion.of(stream.request) for stream in streams]
        deadline = self._deadline_of(streams)
        if len(streams) == 1:
            outputs = aiter(streams[0])
            while True:
                try:
                    out = await self._within(anext(outputs), deadline, streams)
                except StopAsyncIteration:
                    return
                yield _folded(out, completions[0], 0)
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((index, out))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((index, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                index, item = await self._within(queue.get(), deadline, streams)
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finished
                yield _folded(item, completions[index], index)
        finally:
            for task in tasks:
                task.cancel()

    async def _within(self, next_item: Awaitable[T], deadline: Deadline | None, streams: Sequence[RequestStream]) -> T:
        """`next_item` awaited until the deadline; past it the streams are aborted and RequestTimedOut raised."""
        if deadline is None:
            return await next_item
        try:
            return await asyncio.wait_for(next_item, max(0.0, deadline.remaining()))
        except TimeoutError:
            self.abort_unfinished(streams)
            raise RequestTimedOut(deadline.timeout_s) from None


def _folded(delta: CompletionDelta, completion: Completion, index: int) -> GenerationResult:
    completion.add(delta)
    return GenerationResult(index, delta, completion)
