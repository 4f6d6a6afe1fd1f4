"""The engine core in its own process (engine/core_process.py) behind EngineCoreClient (engine/core_client.py): a
real tiny model's greedy tokens equal transformers', admissions and refusals come back as the in-process engine's
errors, aborts return the KV blocks, and a dead core ends its streams with EngineDeadError within seconds."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from batchserve.config import EngineConfig
from batchserve.engine.async_engine import EngineDeadError
from batchserve.engine.core_client import EngineCoreClient, EngineCoreStartError
from batchserve.engine.inputs import RequestBuilder
from batchserve.engine.llm_engine import QueueFullError
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from tests.server.fakes import fake_engine
from tests.tiny_models import hf_greedy, tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "llama", "tiny_llama_core_process")


def _requests(client: EngineCoreClient) -> RequestBuilder:
    return RequestBuilder(client.tokenizer, client.limits)


async def _tokens(client: EngineCoreClient, request) -> list[int]:
    stream = await client.add_request(request)
    return [t async for out in stream for t in out.delta_token_ids]


def test_greedy_tokens_through_the_core_process_equal_transformers(tiny):
    model, directory = tiny
    config = EngineConfig.from_options(model=str(directory), device="cpu", dtype="float32", num_kv_blocks=64)
    client = EngineCoreClient.launch(config)
    try:
        assert client.core_pid != os.getpid() and client.engine.effective_config()["dtype"] == "float32"
        build = _requests(client).build
        prompts = [[1, 5, 9, 2], [7, 3, 3, 8, 11, 4, 60]]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

        async def run():
            return await asyncio.gather(*(_tokens(client, build(f"r{i}", p, params)) for i, p in enumerate(prompts)))

        got = asyncio.run(run())
        assert got == [hf_greedy(model, p, 8) for p in prompts]
        assert client.wait_idle(10) and client.stats().kv_blocks_used == 0
    finally:
        assert client.shutdown() == 0
    assert not client.child.is_alive()


def test_refusals_come_back_as_the_engines_errors_and_aborts_free_blocks():
    client = EngineCoreClient.launch(None, fake_engine, delay_s=0.02, max_waiting_requests=2, max_batch_size=1)
    try:
        build = _requests(client).build
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        listened = []
        client.step_listeners.append(lambda engine, outputs: listened.append(engine.num_steps))

        async def run():
            first = await client.add_request(build("a", [1, 2, 3], long))
            with pytest.raises(InvalidRequestError, match="already in use"):
                await client.add_request(build("a", [4], long))
            await first.get()
            await client.add_request(build("b", [1], long))
            await client.add_request(build("c", [1], long))
            started = time.monotonic()
            with pytest.raises(QueueFullError):  # two wait behind "a" (max_batch_size 1): refused here, at once
                await client.add_request(build("d", [1], long))
            assert time.monotonic() - started < 0.05
            with pytest.raises(QueueFullError):  # what the serving layer asks before it tokenizes a prompt
                client.check_capacity()
            client.abort(["a", "b", "c"])
            with pytest.raises(EngineDeadError, match="aborted"):
                while True:
                    await first.get()

        asyncio.run(run())
        assert client.wait_idle(10)
        deadline = time.monotonic() + 10
        while client.stats().kv_blocks_used and time.monotonic() < deadline:
            time.sleep(0.05)  # the core's next step reports the aborts' blocks freed
        assert client.stats().kv_blocks_used == 0 and listened and listened == sorted(listened)
    finally:
        client.shutdown(drain=False)


def test_a_killed_core_ends_its_streams_and_refuses_new_requests():
    client = EngineCoreClient.launch(None, fake_engine, delay_s=0.02)
    build = _requests(client).build

    async def run():
        stream = await client.add_request(build("x", [1, 2], SamplingParams(max_tokens=200, ignore_eos=True)))
        await stream.get()
        os.kill(client.core_pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="engine core process died.*exit code -9"):
            while True:
                await stream.get()
        assert time.monotonic() - started < 3.0
        with pytest.raises(EngineDeadError):
            await client.add_request(build("y", [1], SamplingParams(max_tokens=2)))

    asyncio.run(run())
    assert not client.is_running and client.error is not None
    client.shutdown()  # nothing left to stop: returns at once


def test_an_engine_that_cannot_be_built_is_a_clear_start_error(tmp_path):
    config = EngineConfig.from_options(model=str(tmp_path / "no-such-model"), device="cpu")
    with pytest.raises(EngineCoreStartError, match="could not be built.*no-such-model"):
        EngineCoreClient.launch(config)
