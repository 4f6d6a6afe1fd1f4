"""Handover: what another replica runs when a request's replica is lost, and how its outputs are renumbered as
the original request's (plain Python, no Ray)."""

from __future__ import annotations

import dataclasses

from batchserve.distributed.migration import Handover
from batchserve.engine.outputs import CompletionDelta, RequestMetrics
from batchserve.request import EngineRequest
from batchserve.sampling_params import ConstraintKind, SamplingParams, StructuredOutputsParams


def _delta(tokens: list[int], prompt: int, done: int, metrics: RequestMetrics) -> CompletionDelta:
    return CompletionDelta("r", tokens, "", None, prompt, done, False, None, None, metrics)


def test_a_request_that_streamed_nothing_is_retried_as_it_was():
    request = EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=8))
    handover = Handover(request)
    assert handover.moves and handover.continuation() is request


def test_a_request_continues_from_what_it_streamed_and_its_outputs_read_as_one_stream():
    params = SamplingParams(max_tokens=10, min_tokens=4, temperature=0, prompt_logprobs=1)
    handover = Handover(EngineRequest("r", [1, 2, 3], params, prompt="abc"))
    before = RequestMetrics(arrival_time=5.0, first_scheduled_time=5.1, first_token_time=5.2, num_cached_tokens=2)
    for tokens, done in (([7], 1), ([8, 9], 3)):
        out = handover.relayed(_delta(tokens, 3, done, before))
        assert out.num_output_tokens == done and out.metrics is before  # untouched before any move

    moved = handover.continuation()
    assert moved.prompt_token_ids == [1, 2, 3, 7, 8, 9] and moved.prompt is None
    assert moved.sampling_params.max_tokens == 7 and moved.sampling_params.min_tokens == 1
    assert moved.sampling_params.prompt_logprobs is None and moved.sampling_params.temperature == 0

    there = RequestMetrics(arrival_time=9.0, first_scheduled_time=9.1, first_token_time=9.3, num_preemptions=1)
    out = handover.relayed(_delta([10], 6, 1, there))
    assert (out.num_prompt_tokens, out.num_output_tokens, out.delta_token_ids) == (3, 4, [10])
    assert out.metrics.arrival_time == 5.0 and out.metrics.first_token_time == 5.2
    assert out.metrics.num_cached_tokens == 2 and out.metrics.num_preemptions == 1
    assert handover.sent == [7, 8, 9, 10]
    again = handover.continuation()  # a second loss: from all four tokens, the budget left
    assert again.prompt_token_ids == [1, 2, 3, 7, 8, 9, 10] and again.sampling_params.max_tokens == 6


def test_only_exact_continuations_move_once_tokens_were_streamed():
    metrics = RequestMetrics(arrival_time=0.0)
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(ConstraintKind.JSON_OBJECT))
    for params in (constrained, SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=0.1)):
        handover = Handover(EngineRequest("r", [1], params))
        assert handover.moves  # nothing sent yet: a plain retry
        handover.relayed(_delta([4], 1, 1, metrics))
        assert not handover.moves
    plain = Handover(EngineRequest("r", [1], dataclasses.replace(SamplingParams(), repetition_penalty=1.2)))
    plain.relayed(_delta([4], 1, 1, metrics))
    assert plain.moves
