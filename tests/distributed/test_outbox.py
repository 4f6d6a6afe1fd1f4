"""The replica's Outbox over a real AsyncLLMEngine (fake runner): a caller's requests leave as one message per engine
step, deltas only (no prompt, no token seen twice), and every request's end is seen; no Ray needed."""

from __future__ import annotations

import asyncio

import pytest

from batchserve.distributed.outbox import Outbox
from batchserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from batchserve.sampling_params import SamplingParams
from tests.server.fakes import fake_engine

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)


async def add(engine, request_id, prompt, params):
    return await engine.add_request(engine.engine.requests.from_prompt(request_id, prompt, params))


@pytest.fixture
def engine():
    async_engine = AsyncLLMEngine(fake_engine(delay_s=0.01)).start()
    yield async_engine
    async_engine.shutdown(drain=False)


def test_a_step_of_several_requests_is_one_message(engine):
    async def run():
        outbox = Outbox()
        steps_before = engine.engine.num_steps
        streams = [await add(engine, f"r{i}", [1, 2, 3 + i], PARAMS) for i in range(4)]
        ended = [outbox.add(s) for s in streams]
        token = outbox.subscribe()
        messages = []
        while (step := await outbox.next(token)) is not None:
            messages.append(step)
        outbox.unsubscribe()
        return messages, ended, outbox, engine.engine.num_steps - steps_before

    messages, ended, outbox, steps = asyncio.run(run())
    outputs = [out for step in messages for out in step.outputs]
    by_request = {f"r{i}": [o for o in outputs if o.request_id == f"r{i}"] for i in range(4)}
    assert all(len(outs) == 6 and outs[-1].finished for outs in by_request.values())  # nothing lost
    assert all([len(o.delta_token_ids) for o in outs] == [1] * 6 for outs in by_request.values())
    # at most one message per engine step (not one per request and step: 24), a step's outputs never split
    assert len(messages) <= steps <= 9 and max(len(step.outputs) for step in messages) >= 4
    for outs in by_request.values():
        assert all(o.num_prompt_tokens == 3 for o in outs) and [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5, 6]
    assert all(f.done() and not f.cancelled() for f in ended) and outbox.unused


def test_an_aborted_request_ends_a_waiting_subscription(engine):
    async def run():
        outbox = Outbox()
        stream = await add(engine, "slow", [1, 2], SamplingParams(max_tokens=10_000, ignore_eos=True))
        ended = outbox.add(stream)
        token = outbox.subscribe()
        first = await outbox.next(token)
        outbox.discard("slow")
        engine.abort("slow")
        rest = await asyncio.wait_for(outbox.next(token), 5)  # not a hang
        return first, rest, ended

    first, rest, ended = asyncio.run(run())
    assert first is not None and first.outputs[0].request_id == "slow"
    assert rest is None and ended.cancelled()


def test_a_newer_subscription_takes_over(engine):
    async def run():
        outbox = Outbox()
        outbox.add(await add(engine, "r", [5], PARAMS))
        old = outbox.subscribe()
        new = outbox.subscribe()
        assert await outbox.next(old) is None
        outputs = []
        while (step := await outbox.next(new)) is not None:
            outputs += step.outputs
        return outputs

    outputs = asyncio.run(run())
    assert len(outputs) == 6 and outputs[-1].finished


def test_an_engine_error_reaches_the_caller_as_the_requests_error(engine):
    async def run():
        outbox = Outbox()
        outbox.add(await add(engine, "r", [5], SamplingParams(max_tokens=10_000, ignore_eos=True)))
        token = outbox.subscribe()
        await outbox.next(token)
        engine.shutdown(drain=False)  # every request in flight ends with EngineDeadError
        errors = {}
        while (step := await asyncio.wait_for(outbox.next(token), 5)) is not None:
            errors.update(step.errors)
        return errors, outbox

    errors, outbox = asyncio.run(run())
    assert isinstance(errors.get("r"), EngineDeadError) and outbox.idle
