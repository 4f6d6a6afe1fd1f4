"""Long-prompt isolation (vLLM's long_prefill_token_threshold, max_long_partial_prefills, max_num_partial_prefills):
a long prompt is chunked across steps, so the decodes running beside it never wait for more than the step's long
prefill budget; a long prompt waiting for a slot does not hold up the short ones behind it."""

from __future__ import annotations

from batchserve.core.prefill_limits import PrefillLimits
from tests.core.helpers import assert_all_blocks_free, drive, make_request, make_scheduler
from tests.fake_runner import FakeRunner

BLOCKS = 2048
LONG, SHORT = 1000, 12


def _mix(scheduler_options: dict) -> tuple[list[tuple[dict, set[str]]], dict]:
    """Eight short requests decoding, then three long prompts and two more short ones: every step's scheduled
    tokens and the set of requests that were decoding when it was built."""
    scheduler = make_scheduler(BLOCKS, max_num_tokens=512, max_batch_size=16, **scheduler_options)
    runner = FakeRunner(BLOCKS, 4)
    shorts = [make_request(f"s{i}", prompt_len=SHORT, max_tokens=40) for i in range(8)]
    longs = [make_request(f"long{i}", prompt_len=LONG, max_tokens=4) for i in range(3)]
    late = [make_request(f"late{i}", prompt_len=SHORT, max_tokens=4) for i in range(2)]
    steps = []

    def record(sched, out):
        steps.append((dict(out.num_scheduled_tokens), decoding_before.copy()))

    decoding_before: set[str] = set()

    def on_step(sched, out):
        record(sched, out)
        decoding_before.clear()
        decoding_before.update(r.request_id for r in sched.running if r.num_tokens - r.num_computed_tokens == 1)

    outputs = drive(scheduler, runner, {0: shorts, 3: longs, 4: late}, on_step=on_step)
    assert_all_blocks_free(scheduler)
    return steps, outputs


def _long_prefill_tokens(scheduled: dict) -> int:
    return sum(n for rid, n in scheduled.items() if rid.startswith("long") and n > 1)


def test_a_long_prefill_never_takes_more_than_the_budget_from_a_decode_step():
    """Every chunk is at most the threshold, and at most max_num_partial_prefills chunks share a step: a decode step
    carries at most 2 x 64 prompt tokens, however long the prompts."""
    options = dict(long_prefill_token_threshold=64, max_long_partial_prefills=1, max_num_partial_prefills=2)
    steps, outputs = _mix(options)
    with_decodes = [(s, d) for s, d in steps if d]
    assert len(with_decodes) > 20
    for scheduled, decoding in with_decodes:
        chunks = [n for n in scheduled.values() if n > 1]
        assert max(chunks, default=0) <= 64 and sum(chunks) <= 128, scheduled
        assert decoding <= set(scheduled), "a running decode was left out of a step"
    assert all(len(outputs[f"long{i}"]) == 4 for i in range(3))  # every long prompt was still served


def test_without_the_budget_a_long_prefill_fills_the_decode_steps():
    """The check above can fail: with no threshold a long prompt takes the whole remaining token budget."""
    steps, _ = _mix({})
    assert max(_long_prefill_tokens(s) for s, d in steps if d) > 400


def test_a_short_request_overtakes_a_long_one_waiting_for_a_long_prefill_slot():
    steps, _ = _mix(dict(long_prefill_token_threshold=64, max_long_partial_prefills=1))
    first = {}
    for i, (scheduled, _) in enumerate(steps):
        for rid in scheduled:
            first.setdefault(rid, i)
    assert first["late0"] < first["long1"] and first["late1"] < first["long1"]
    assert first["long0"] < first["long1"] < first["long2"]  # one long prompt at a time, in arrival order
    # a prompt is long while more than the threshold is left: its chunks are then exactly the threshold
    concurrent_longs = [sum(1 for rid, n in s.items() if rid.startswith("long") and n == 64) for s, _ in steps]
    assert max(concurrent_longs) == 1


def test_max_num_partial_prefills_bounds_prefills_of_any_length():
    steps, _ = _mix(dict(max_num_partial_prefills=2))
    prefills = [sum(1 for n in s.values() if n > 1) for s, _ in steps]
    assert max(prefills) == 2


def test_limits_count_what_they_let_in():
    limits = PrefillLimits(threshold=100, max_partial=2, max_long=1)
    long_a, long_b, short = make_request("a", 300), make_request("b", 300), make_request("c", 50)
    assert limits.admits(long_a) and limits.cap(long_a, 512) == 100 and limits.cap(short, 512) == 512
    limits.count(long_a)
    assert not limits.admits(long_b) and limits.admits(short)
    limits.count(short)
    assert not limits.admits(make_request("d", 20))  # two prefills already
    assert PrefillLimits(threshold=100, chunking=False).cap(long_a, 512) == 512  # unchunked: counts only
