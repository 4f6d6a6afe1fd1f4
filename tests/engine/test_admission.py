"""Requests that can never be served are refused at once, with the limit named; bad input to the offline API is an
InvalidRequestError and leaves nothing behind; nothing can wedge the queue."""

from __future__ import annotations

import pytest

from batchserve.entrypoints.llm import LLM
from batchserve.request import FinishReason
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from tests.core.helpers import make_request, make_scheduler
from tests.doubles import run_to_completion
from tests.fake_runner import FakeRunner

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SMALL_POOL = {"num_kv_blocks": 16, "block_size": 16, "max_model_len": 2048}  # the pool (256 tokens) is the limit


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict", "static"])
def test_a_request_larger_than_the_pool_is_refused_and_the_queue_moves(make_engine, policy):
    engine = make_engine(scheduler_policy=policy, **SMALL_POOL)
    assert engine.limits.max_model_len == 256 and engine.limits.max_input_len == 255
    with pytest.raises(InvalidRequestError, match=r"300 tokens.*KV cache holds .* = 256") as refused:
        engine.add_prompt("too-long", [1] * 300, SamplingParams(max_tokens=4, **GREEDY))
    assert refused.value.param == "prompt"
    # fits the pool, but not with all of its max_tokens: it runs until the pool is full, then ends by length
    engine.add_prompt("big", [1] * 200, SamplingParams(max_tokens=200, **GREEDY))
    for i in range(4):
        engine.add_prompt(f"small-{i}", [2] * 10, SamplingParams(max_tokens=5, **GREEDY))
    done = run_to_completion(engine, max_steps=2000)
    assert len(done["big"].token_ids) == 56 and done["big"].finish_reason == "length"
    assert all(len(done[f"small-{i}"].token_ids) == 5 for i in range(4))
    assert engine.scheduler.kv.pool.num_free_blocks == 16


def test_a_prompt_over_the_pool_is_truncated_when_asked(make_engine):
    engine = make_engine(truncation="left", **SMALL_POOL)
    prompt = [i % 200 for i in range(300)]
    request = engine.requests.from_prompt("long", prompt, SamplingParams(max_tokens=3, **GREEDY))
    engine.add_request(request)
    done = run_to_completion(engine)
    assert request.prompt_token_ids == prompt[-255:] and len(done["long"].token_ids) == 1


def test_without_chunked_prefill_a_prompt_longer_than_a_step_is_refused(make_engine):
    engine = make_engine(enable_chunked_prefill=False, max_num_tokens=64, max_model_len=None)
    with pytest.raises(InvalidRequestError, match="max_input_len"):
        engine.add_prompt("r", [1] * 65, SamplingParams(max_tokens=2, **GREEDY))
    engine.add_prompt("r", [1] * 64, SamplingParams(max_tokens=2, **GREEDY))
    assert len(run_to_completion(engine)["r"].token_ids) == 2


def test_the_scheduler_ends_a_head_that_can_never_be_admitted():
    # a scheduler used on its own (no engine limits in front): a prompt longer than a step without chunking
    scheduler = make_scheduler(num_blocks=16, block_size=4, enable_chunked_prefill=False, max_num_tokens=8)
    runner = FakeRunner(16, 4)
    stuck, behind = make_request("stuck", prompt_len=12, max_tokens=2), make_request("ok", prompt_len=6, max_tokens=2)
    scheduler.add_request(stuck)
    scheduler.add_request(behind)
    ended: dict[str, FinishReason] = {}
    for _ in range(10):
        out = scheduler.schedule()
        for result in scheduler.update_from_output(out, runner.execute(out)):
            if result.finished:
                ended[result.request_id] = result.finish_reason
        if not scheduler.has_unfinished_requests():
            break
    assert ended == {"stuck": FinishReason.ABORT, "ok": FinishReason.LENGTH}


# ---------------------------------------------------------------------------------------------- offline API
@pytest.mark.parametrize(
    ("make_params", "field"),
    [
        (lambda: SamplingParams(seed=1.5), "seed"),
        (lambda: SamplingParams(stop=123), "stop"),
        (lambda: SamplingParams(stop=""), "stop"),
        (lambda: SamplingParams(temperature="0.5"), "temperature"),
        (lambda: SamplingParams(max_tokens=True), "max_tokens"),
        (lambda: SamplingParams(top_p=float("nan")), "top_p"),
        (lambda: SamplingParams(logprobs=21), "logprobs"),
        (lambda: SamplingParams(ignore_eos="yes"), "ignore_eos"),
        (lambda: SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
        (lambda: SamplingParams(n=0), "n"),
    ],
)
def test_sampling_params_check_every_type_and_range(make_params, field):
    with pytest.raises(InvalidRequestError) as error:
        make_params()
    assert error.value.param == field and field in str(error.value)


def test_a_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda llm: llm.generate(None), "prompts must be"),
        (lambda llm: llm.generate([None]), "not NoneType"),
        (lambda llm: llm.generate(["ok", 5]), "not int"),
        (lambda llm: llm.generate(["ok", ""]), "empty"),
        (lambda llm: llm.generate(["ok", {"text": "x"}]), "needs 'prompt'"),
        (lambda llm: llm.generate(["ok"], [SamplingParams(), SamplingParams()]), "2 sampling params for 1"),
        (lambda llm: llm.generate(["ok"], "greedy"), "sampling_params must be"),
        (lambda llm: llm.chat([{"role": "user"}]), "needs 'content'"),
        (lambda llm: llm.chat([{"role": "wizard", "content": "x"}]), "role must be"),
        (lambda llm: llm.chat([{"role": "user", "content": 5}]), "content must be a string"),
    ],
)
def test_offline_api_refuses_bad_input_and_leaves_nothing_behind(make_engine, call, message):
    llm = LLM.from_engine(make_engine())
    with pytest.raises(InvalidRequestError, match=message):
        call(llm)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.engine.scheduler.kv.pool.num_blocks
    (out,) = llm.generate(["abc"], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert len(out.token_ids) == 3
