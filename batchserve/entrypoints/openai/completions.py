"""POST /v1/completions: one or more prompts (text or token ids), streamed over SSE or answered at once."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from batchserve.core.outputs import Logprobs
from batchserve.engine.async_engine import RequestStream
from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.front import OpenAIFrontEnd, chunk_usage, finish_fields, sampling_params
from batchserve.entrypoints.openai.protocol import CompletionRequest, UsageInfo
from batchserve.entrypoints.openai.request_context import request_id_of
from batchserve.entrypoints.openai.scoring import (
    Entry,
    Scoring,
    output_entries,
    prompt_entries,
    scoring_params,
    vllm_prompt_logprobs,
)
from batchserve.entrypoints.openai.streaming import AbortOnCloseResponse, sse_events, wait_for_disconnect
from batchserve.serving.fanout import choices_usage, submit_choices
from batchserve.serving.results import GenerationResult, Usage

Prompt = str | list[int]


async def create_completion(front: OpenAIFrontEnd, request: Request) -> Response:
    req = await front.parse(request, CompletionRequest)
    deadline = front.service.deadline(req.timeout)  # from arrival: tokenizing counts
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError(400, "best_of must be 1", param="best_of")
    prompts = _prompts(req.prompt)
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    scoring_only = req.echo and max_tokens == 0  # the engine samples one token, which the answer leaves out
    params = front.with_adapter(sampling_params(req, 1 if scoring_only else max_tokens, req.logprobs), req.model)
    params, scoring = scoring_params(params, req.echo, req.logprobs, max_tokens, req.prompt_logprobs)
    request_id = request_id_of(request, "cmpl")  # X-Request-Id when the client sent one
    streams = await submit_choices(front.service, request_id, prompts, params, req.priority, deadline)
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": params.lora_name or front.model_name}  # fmt: skip
    if req.stream:
        chunks = _stream(front, req, head, prompts, streams, scoring)
        return AbortOnCloseResponse(sse_events(chunks), lambda: front.service.abort_unfinished(streams))
    results = await front.service.final_results(streams, wait_for_disconnect(request))
    choices = []
    for result in results:
        completion = result.completion
        prefix = _echo(front, prompts[result.index // req.n], result) if req.echo else ""
        text = prefix + ("" if scoring.score_only else completion.text)
        entries = _entries(result, scoring, completion.prompt_logprobs, completion.logprobs or [])
        logprobs = (
            _logprobs(front, entries, 0 if scoring.echo_logprobs else len(prefix)) if req.logprobs is not None else None
        )
        choice = {"index": result.index, "text": text, "logprobs": logprobs, **_finish(result, scoring)}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                completion.prompt_token_ids, completion.prompt_logprobs, front.service.token_text
            )
        choices.append(choice)
    return JSONResponse({**head, "choices": choices, "usage": UsageInfo.of(_usage(results, req.n, scoring))})


def _entries(
    result: GenerationResult, scoring: Scoring, prompt_scores: list[Logprobs | None] | None, output: list[Logprobs]
) -> list[Entry]:
    """A choice's logprob entries (or a stream chunk's): the prompt's first when echoed, then the output's."""
    entries = prompt_entries(result.completion.prompt_token_ids, prompt_scores) if scoring.echo_logprobs else []
    return entries + ([] if scoring.score_only else output_entries(output))


def _finish(result: GenerationResult, scoring: Scoring) -> dict[str, str | int | None]:
    if scoring.score_only and result.finished:
        return {"finish_reason": "length", "stop_reason": None}  # nothing was generated: the budget was 0
    return finish_fields(result)


def _usage(results: list[GenerationResult], n: int, scoring: Scoring) -> Usage:
    usage = choices_usage(results, n)
    return dataclasses.replace(usage, completion_tokens=0) if scoring.score_only else usage


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """One prompt or a batch of them; each is checked when the serving layer builds its engine request."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
    return list(prompt)  # type: ignore[arg-type]


def _echo(front: OpenAIFrontEnd, prompt: Prompt, result: GenerationResult) -> str:
    return prompt if isinstance(prompt, str) else front.service.tokenizer.decode(result.completion.prompt_token_ids)


async def _stream(
    front: OpenAIFrontEnd, req: CompletionRequest, head: dict[str, Any], prompts: list[Prompt],
    streams: list[RequestStream], scoring: Scoring,
) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    finals: list[GenerationResult] = []
    sent: dict[int, int] = {}  # characters sent per choice (the logprobs' text offsets)
    async for result in front.service.results(streams):
        first = result.index not in sent
        delta = "" if scoring.score_only else result.delta.delta_text
        if req.echo and first:
            delta = _echo(front, prompts[result.index // req.n], result) + delta
        if not delta and not result.finished:
            continue
        offset = sent.get(result.index, 0)
        sent[result.index] = offset + len(delta)
        prompt_scores = result.delta.prompt_logprobs if first else None
        entries = _entries(result, scoring, prompt_scores, result.delta_logprobs) if first else (
            [] if scoring.score_only else output_entries(result.delta_logprobs))  # fmt: skip
        logprobs = _logprobs(front, entries, offset) if req.logprobs is not None else None
        if result.finished:
            finals.append(result)
        choice = {"index": result.index, "text": delta, "logprobs": logprobs, **_finish(result, scoring)}
        if req.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                result.completion.prompt_token_ids, prompt_scores, front.service.token_text
            )
        yield {**head, "choices": [choice], **chunk_usage(req, result)}
    if req.include_usage:
        yield {**head, "choices": [], "usage": UsageInfo.of(_usage(finals, req.n, scoring))}


def _logprobs(front: OpenAIFrontEnd, entries: list[Entry], offset: int) -> dict[str, Any]:
    token_text = front.service.token_text
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, logprob, top in entries:
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append({token_text(t): lp for t, lp in top.items()} if top is not None else None)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
