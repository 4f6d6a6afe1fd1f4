"""`n > 1`: each prompt's choices as child requests that share its KV blocks. The first child of each prompt is
admitted alone; once it has its first output (its prompt computed and its full blocks in the prefix cache) the
others are admitted and find the prompt there: one prefill per prompt, not n. Choice i of prompt p has index
p * n + i, as OpenAI numbers them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Sequence

from batchserve.engine.async_engine import RequestStream
from batchserve.request import EngineRequest
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from batchserve.serving.generation import MAX_PROMPTS_PER_REQUEST, Deadline, GenerationService
from batchserve.serving.results import GenerationResult, Usage


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """n copies with n=1; a seeded request's children draw from seeds seed, seed+1, ... (distinct, reproducible)."""
    seeds = [None if params.seed is None else (params.seed + i) % 2**64 for i in range(params.n)]
    return [dataclasses.replace(params, n=1, seed=seed) for seed in seeds]


async def submit_choices(
    service: GenerationService, base_id: str, prompts: Sequence[str | list[int]], params: SamplingParams,
    priority: int = 0, deadline: Deadline | None = None,
) -> list[RequestStream]:  # fmt: skip
    """Streams in choice order (prompt-major); all admitted or none. `deadline`: when they must all be done."""
    if params.n == 1:
        return await service.submit(base_id, prompts, params, priority, deadline)
    if len(prompts) * params.n > MAX_PROMPTS_PER_REQUEST:
        raise InvalidRequestError(
            f"prompts x n may be at most {MAX_PROMPTS_PER_REQUEST}, got {len(prompts)} x {params.n}", "n"
        )
    children = child_params(params)
    groups: list[list[EngineRequest]] = []
    for p, prompt in enumerate(prompts):  # tokenized and checked once per prompt, every choice built before any runs
        first = await service.request(f"{base_id}-{p}-0", prompt, children[0], priority)
        groups.append([first] + [dataclasses.replace(first, request_id=f"{base_id}-{p}-{i}", sampling_params=c)
                                 for i, c in enumerate(children[1:], start=1)])  # fmt: skip
    deadline = deadline if deadline is not None else service.deadline(None)
    firsts = await service.admit([group[0] for group in groups], deadline)
    try:
        await asyncio.gather(*(_first_output(s) for s in firsts))
        rests = await service.admit([r for group in groups for r in group[1:]], deadline)
    except BaseException:
        service.abort_unfinished(firsts)
        raise
    per_prompt = params.n - 1
    return [s for p, first in enumerate(firsts) for s in [first, *rests[p * per_prompt : (p + 1) * per_prompt]]]


async def _first_output(stream: RequestStream) -> None:
    """Until the stream holds an output (or an error), without taking it."""
    arrived = asyncio.Event()
    stream.listener = arrived.set
    try:
        while not stream.has_output:
            await arrived.wait()
            arrived.clear()
    finally:
        stream.listener = None


def choices_usage(results: Iterable[GenerationResult], n: int) -> Usage:
    """Usage of a request's choices: each prompt counted once (its first choice's), every choice's output."""
    results = list(results)
    firsts = [r for r in results if r.index % n == 0]
    whole = Usage.of(results)
    return Usage(sum(r.delta.num_prompt_tokens for r in firsts), whole.completion_tokens,
                 sum(r.delta.metrics.num_cached_tokens for r in firsts))  # fmt: skip
