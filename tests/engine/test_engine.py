import asyncio

import pytest

from batchserve.core.outputs import Logprobs
from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.engine.llm_engine import QueueFullError
from batchserve.engine.outputs import Completion, CompletionDelta, RequestMetrics
from batchserve.entrypoints.llm import LLM
from batchserve.request import EngineRequest
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from tests.doubles import LETTERS, reference_generation, run_to_completion

GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_STEPS = 1000  # every test here finishes in far fewer steps; past it the scheduler is stuck


def run_all(engine):
    return run_to_completion(engine, MAX_STEPS)


def letters(ids):
    """The byte tokenizer's text of ids below 26, written out independently of it: 0 -> "a", ..., 25 -> "z"."""
    assert all(0 <= i < LETTERS for i in ids)
    return "".join(chr(ord("a") + i) for i in ids)


def test_outputs_in_input_order_with_text_and_timings(make_engine, tokenizer):
    llm = LLM.from_engine(make_engine(max_batch_size=3))
    prompt_ids = [list(range(1, 2 + i * 3)) for i in range(7)]
    prompts = [letters(ids) for ids in prompt_ids]  # text prompts: "b", "bcde", ...
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    for ids, out in zip(prompt_ids, outs, strict=True):
        assert out.prompt_token_ids == ids
        assert out.token_ids == reference_generation(ids, 5, LETTERS)
        assert out.text == letters(out.token_ids) == tokenizer.decode(out.token_ids)
        assert out.finish_reason == "length"
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_stop_string_cuts_text_and_finishes(make_engine):
    engine = make_engine()
    expected = reference_generation([5, 6, 7], 10, LETTERS)
    stop = letters(expected[2:4])
    assert letters(expected).find(stop) == 2  # the stop string first appears after two tokens
    engine.add_prompt("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=10, stop=[stop], **GREEDY))
    out = run_all(engine)["a"]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == letters(expected[:2])
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks


def test_streamed_deltas_concatenate_to_the_text(make_engine, tokenizer):
    engine = make_engine()
    engine.add_prompt("a", [3, 4], SamplingParams(max_tokens=12, **GREEDY))
    pieces, ids, final = [], [], None
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            pieces.append(out.delta_text)
            ids += out.delta_token_ids
            final = out
    else:
        pytest.fail(f"request unfinished after {MAX_STEPS} steps")
    assert final.finished and len(ids) == final.num_output_tokens == 12
    assert "".join(pieces) == tokenizer.decode(ids) == letters(ids)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", {}, "empty"),
        ([], {}, "empty"),
        ([1] * 300, {}, "more than"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 5000], {}, "token ids"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(make_engine, prompt, params, message):
    engine = make_engine()
    engine.add_prompt("good", [1, 2, 3], SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_prompt("bad", prompt, SamplingParams(**params))
    assert run_all(engine)["good"].token_ids == reference_generation([1, 2, 3], 3, LETTERS)


@pytest.mark.parametrize("truncation, expected", [("left", list(range(11, 21))), ("right", list(range(1, 11)))])
def test_truncation(make_engine, truncation, expected):
    engine = make_engine(max_input_len=10, truncation=truncation)
    request = engine.requests.from_prompt("a", list(range(1, 21)), SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request(request)
    assert request.prompt_token_ids == expected and len(run_all(engine)["a"].token_ids) == 2


def test_abort_reports_and_frees(make_engine):
    engine = make_engine()
    engine.add_prompt("a", [1, 2, 3], SamplingParams(max_tokens=50, **GREEDY))
    engine.add_prompt("b", [1, 2, 3], SamplingParams(max_tokens=5, **GREEDY))
    engine.step()
    engine.abort_request("a")
    done = run_all(engine)
    assert done["a"].finish_reason == "abort" and done["b"].finish_reason == "length"
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks


def test_bounded_waiting_queue(make_engine):
    engine = make_engine(max_waiting_requests=2)
    engine.add_prompt("a", [1], SamplingParams(max_tokens=2, **GREEDY))
    engine.add_prompt("b", [1], SamplingParams(max_tokens=2, **GREEDY))
    with pytest.raises(QueueFullError):
        engine.add_prompt("c", [1], SamplingParams(max_tokens=2, **GREEDY))
    run_all(engine)
    engine.add_prompt("c", [1], SamplingParams(max_tokens=2, **GREEDY))


def test_step_records_and_stats(make_engine):
    engine = make_engine(record_steps=True, max_batch_size=4)
    for i in range(6):
        engine.add_prompt(None, list(range(1, 10 + i)), SamplingParams(max_tokens=4, **GREEDY))
    run_all(engine)
    records = engine.step_records
    assert records and all(r.stats.num_scheduled_seqs <= 4 for r in records)
    assert sum(r.stats.num_decode_tokens for r in records) == 6 * 3
    assert engine.last_stats.kv_blocks_used == 0


def test_effective_config_is_logged_at_start_up_with_what_the_engine_resolved(make_engine, caplog):
    with caplog.at_level("INFO", logger="batchserve.engine.llm_engine"):
        engine = make_engine(max_batch_size=5, num_kv_blocks=40, max_model_len=None, truncation="LEFT")
    effective = engine.effective_config()
    # the pool bounds the context (40 blocks x 16 tokens), the enum is its value, nothing is left unresolved
    assert effective["max_model_len"] == "640" and effective["num_kv_blocks"] == "40"
    assert effective["max_batch_size"] == "5" and effective["truncation"] == "left"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("effective config:")]
    assert "max_batch_size=5" in line and "max_model_len=640" in line and "enable_prefix_caching=True" in line


def test_effective_config_names_the_default_model_rather_than_none(make_engine):
    engine = make_engine()
    assert engine.config.model is None  # the test engine runs the default model
    assert engine.effective_config()["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf (the default)"


def test_a_built_request_reaches_the_scheduler_unchanged(make_engine, tokenizer):
    """Built (tokenized, checked) once; the async engine's stream and the scheduler hold that very request's data."""
    engine = make_engine(delay_s=0.005)
    params = SamplingParams(max_tokens=200, **GREEDY)  # ~1 s of steps: still running when it is looked at
    request = engine.requests.from_prompt("r", "abc", params, priority=2)
    assert request.prompt == "abc" and request.prompt_token_ids == tokenizer.encode("abc")
    async_engine = AsyncLLMEngine(engine).start()
    try:
        stream = asyncio.run(async_engine.add_request(request))
        scheduled = engine.scheduler.requests["r"]
    finally:
        async_engine.shutdown(drain=False)
    assert stream.request is request
    assert scheduled.prompt_token_ids is request.prompt_token_ids and scheduled.sampling_params is params
    assert (scheduled.priority, scheduled.arrival_time) == (2, request.arrival_time)


def test_the_engine_loop_closes_its_runner_when_it_stops(make_engine):
    """The runner's helper threads (the grammar masks' worker) end with the engine loop, not with the process."""
    engine = make_engine()
    async_engine = AsyncLLMEngine(engine).start()
    assert not engine.runner.closed
    async_engine.shutdown()
    assert engine.runner.closed


def test_a_completion_folds_deltas_into_the_whole_output():
    """Outputs carry deltas; a Completion gathers them: ids and logprobs in order, the text, the running sum."""
    entries = [Logprobs(t, -0.1 * (t + 1), 1, {}) for t in range(5)]
    params = SamplingParams(max_tokens=5, logprobs=0)
    completion = Completion.of(EngineRequest("r", [7, 8], params, prompt="hi"))
    metrics = RequestMetrics(arrival_time=0.0)
    for start, stop, text in [(0, 2, "ab"), (2, 3, ""), (3, 5, "cde")]:
        delta = CompletionDelta("r", list(range(start, stop)), text, entries[start:stop], 2, stop, stop == 5,
                                "length" if stop == 5 else None, None, metrics)  # fmt: skip
        completion.add(delta)
    assert completion.token_ids == [0, 1, 2, 3, 4] and completion.logprobs == entries and completion.text == "abcde"
    assert completion.cumulative_logprob == sum(e.logprob for e in entries) and completion.finish_reason == "length"
    assert (completion.prompt, completion.prompt_token_ids, completion.outputs) == ("hi", [7, 8], [completion])


def test_a_cancelled_add_of_a_taken_id_leaves_the_running_request_alone(make_engine):
    """A caller that gives up while its add waits must not abort another request that holds the same id (a
    client's X-Request-Id is the engine request's id): the add never ran, so there is nothing of its to abort."""
    engine = make_engine(delay_s=0.002)
    async_engine = AsyncLLMEngine(engine).start()

    async def scenario():
        params = SamplingParams(max_tokens=40, **GREEDY)
        first = await async_engine.add_request(engine.requests.from_prompt("x", [1, 2, 3], params))
        with async_engine._cond:  # the loop cannot take the second add until the caller has given up on it
            second = asyncio.ensure_future(async_engine.add_request(engine.requests.from_prompt("x", [4], params)))
            await asyncio.sleep(0.05)
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
        return [out async for out in first]

    try:
        outputs = asyncio.run(scenario())
    finally:
        async_engine.shutdown(drain=False)
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 40
