"""Drive any OpenAI-compatible server (batchserve, vLLM, llama.cpp) over HTTP: streaming completions at
/v1/completions, or chat completions at /v1/chat/completions (vLLM's `openai-chat` backend), or any --endpoint."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
from tqdm import tqdm

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import RequestResult
from batchserve.bench.trace import RunTrace
from batchserve.bench.workloads import BenchRequest

PROMPT_FORMATS = ("tokens", "text")
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("/chat/completions")


def completion_body(
    req: BenchRequest, model: str, prompt_format: str = "tokens", tokenizer: Any = None, endpoint: str = COMPLETIONS
) -> dict:
    """The streaming request for `endpoint`: a completion (prompt as token ids or text), or a chat completion (the
    prompt as one user message's text, as vLLM's openai-chat backend sends it)."""
    chat = is_chat(endpoint)
    if prompt_format == "tokens" and not chat:
        prompt: Any = req.prompt_token_ids
    elif req.prompt_text is not None:
        prompt = req.prompt_text
    elif tokenizer is not None:
        prompt = tokenizer.decode(req.prompt_token_ids)
    else:
        raise ValueError("prompt_format='text' (and any chat endpoint) needs a tokenizer to decode synthetic prompts")
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": req.ignore_eos, "stream_options": {"include_usage": True}}  # fmt: skip
    if chat:
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


def _chunk_text(choice: dict) -> str:
    """A completion chunk's text, or a chat chunk's delta content."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def served_models(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, str | None]:
    """The server's /v1/models: each served name -> its card's root (the model the server loaded, when it says)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s)
    resp.raise_for_status()
    return {card["id"]: card.get("root") for card in resp.json()["data"]}


async def _first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def stream_one(
    client: httpx.AsyncClient, body: dict, result: RequestResult, endpoint: str = COMPLETIONS
) -> RequestResult:
    """POST one streaming completion, time every chunk that carries text; usage (if sent) gives the token counts
    (the prompt's as the server tokenized it: a text prompt need not give back the workload's ids)."""
    chunks, usage_tokens = 0, None
    try:
        async with client.stream("POST", endpoint, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.monotonic()
                if chunk.get("error"):
                    raise RuntimeError(str(chunk["error"]))
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    usage_tokens = usage["completion_tokens"]
                if usage.get("prompt_tokens") is not None:
                    result.prompt_len = usage["prompt_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if cached is not None:  # vLLM (with --enable-prompt-tokens-details) and others report it
                    result.num_cached_tokens = cached
                choices = chunk.get("choices") or []
                if choices and _chunk_text(choices[0]):
                    chunks += 1
                    result.record_delivery(now)
        result.end_stream(time.monotonic(), usage_tokens if usage_tokens is not None else chunks)
    except Exception as exc:  # noqa: BLE001 - a benchmark records the failure and goes on
        result.record_failure(exc)
    return result


async def _run(
    base_url: str,
    requests: list[BenchRequest],
    arrivals: ArrivalProcess,
    seed: int,
    model: str | None,
    prompt_format: str,
    tokenizer: Any,
    label: str,
    progress: bool,
    timeout_s: float,
    api_key: str | None,
    transport: httpx.AsyncBaseTransport | None,
    on_result: Callable[[RequestResult], None],
    endpoint: str,
) -> RunTrace:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers, limits=limits, transport=transport
    ) as client:
        model = model or await _first_model(client)
        bodies = [completion_body(r, model, prompt_format, tokenizer, endpoint) for r in requests]
        offsets = arrivals.offsets(len(requests), seed)
        gate = asyncio.Semaphore(arrivals.max_concurrency or len(requests))
        bar = tqdm(total=len(requests), desc=label, unit="req", disable=not progress)
        t0 = time.monotonic()

        async def send(req: BenchRequest, body: dict, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            async with gate:
                arrival = max(time.monotonic(), t0 + offset) if arrivals.max_concurrency else t0 + offset
                result = RequestResult(req.request_id, req.prompt_len, 0, arrival, category=req.category)
                await stream_one(client, body, result, endpoint)
            on_result(result)
            bar.update(1)
            return result

        results = await asyncio.gather(*(send(r, b, o) for r, b, o in zip(requests, bodies, offsets, strict=True)))
        bar.close()
        duration = time.monotonic() - t0
    meta = {"duration_s": duration, "target": base_url + endpoint, "model": model, "arrivals": arrivals.describe()}
    return RunTrace(label, t0, 1, [], list(results), meta)


def run_http(
    base_url: str,
    requests: list[BenchRequest],
    arrivals: ArrivalProcess | None = None,
    seed: int = 0,
    model: str | None = None,
    prompt_format: str = "tokens",
    tokenizer: Any = None,
    label: str = "http",
    progress: bool = True,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
    endpoint: str = COMPLETIONS,
) -> RunTrace:
    """Send the workload to base_url + endpoint (e.g. http://localhost:8000, /v1/completions) and return the trace
    (requests only, no steps); `on_result` is called with each request as it finishes (the partial-results log)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}")
    return asyncio.run(
        _run(base_url, requests, arrivals or ArrivalProcess(), seed, model, prompt_format, tokenizer, label,
             progress, timeout_s, api_key, transport, on_result or (lambda result: None), endpoint)
    )  # fmt: skip
