"""Speculative decoding on the scheduler's side: n-gram proposals, k by load, eligibility, and the step accounting of
drafts (scheduled as query tokens, counted in the token budget, rolled back on rejection with exact block ids)."""

from __future__ import annotations

import pytest

from batchserve.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig, SpeculativeConfig
from batchserve.core.build import build_scheduler
from batchserve.core.outputs import ModelOutput
from batchserve.core.speculative import NgramProposer, SpeculationPlanner
from tests.core.helpers import make_request


def test_ngram_proposes_what_followed_the_most_recent_match_of_the_longest_suffix():
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # the 3-gram (1, 2, 3) last occurred at 5..7: what followed it there
    assert proposer.propose(tokens, 2) == [7, 8]
    assert proposer.propose(tokens, 10) == [7, 8, 5, 1, 2, 3]
    # no 3- or 2-gram match: falls back to the 1-gram (5) -> 1, 2
    assert proposer.propose([5, 1, 2, 4, 6, 5], 2) == [1, 2]
    assert NgramProposer(min_n=2, max_n=3).propose([5, 1, 2, 4, 6, 5], 2) == []
    assert proposer.propose([4], 3) == []


def test_k_shrinks_with_the_running_batch_and_is_off_from_the_limit():
    planner = SpeculationPlanner(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8))
    assert [planner.k_for_load(n) for n in (1, 2, 4, 6, 7, 8, 64)] == [4, 3, 2, 1, 1, 0, 0]


def test_drafts_respect_max_tokens_the_budget_and_opt_outs():
    planner = SpeculationPlanner(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    prompt = [1, 2, 3, 4, 5, 6, 1]
    assert planner.propose(make_request("a", prompt=prompt, max_tokens=100), 1, 100, 1000) == [2, 3, 4, 5]
    assert planner.propose(make_request("b", prompt=prompt, max_tokens=3), 1, 100, 1000) == [2, 3]
    assert planner.propose(make_request("c", prompt=prompt, max_tokens=100), 1, 3, 1000) == [2, 3]
    assert planner.propose(make_request("d", prompt=prompt, max_tokens=100), 1, 100, 9) == [2]
    for opt_out in ({"speculate": False}, {"logprobs": 2}):
        assert planner.propose(make_request("e", prompt=prompt, max_tokens=100, **opt_out), 1, 100, 1000) == []


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"method": "eagle9"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"k": 3}, "unknown key"),
        ({"k_policy": "greedy"}, "k_policy"),
    ],
)
def test_bad_speculative_configs_are_refused_with_the_reason(spec, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig.from_options(speculative_config=spec)


def _scheduler(num_blocks=16, **spec):
    config = SpeculativeConfig(**{"prompt_lookup_min": 1, **spec})
    cache = CacheConfig(block_size=4, enable_prefix_caching=True)
    return build_scheduler(SchedulerConfig(max_num_tokens=64), cache, num_blocks, speculative=config)


def test_drafts_are_query_tokens_and_rejected_ones_give_their_blocks_back():
    s = _scheduler(num_speculative_tokens=4)
    prompt = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1]  # 10 tokens: blocks 0-2 after the prefill
    s.add_request(make_request("r", prompt=prompt, max_tokens=20))
    first = s.schedule()
    s.update_from_output(first, ModelOutput(["r"], [2]))  # ... 1, 2: the proposal is what followed "1 2": 3 4 5 6
    step = s.schedule()
    assert step.spec_token_ids == {"r": [3, 4, 5, 6]}
    assert step.num_scheduled_tokens == {"r": 5}
    request = s.requests["r"]
    assert [b.block_id for b in s.kv.blocks_of(request)] == [0, 1, 2, 3]  # positions 10..15 need block 3
    # the target accepts "3" only, then says 9
    out = s.update_from_output(step, ModelOutput(["r"], [9], accepted_token_ids={"r": [3]}))
    assert out[0].new_token_ids == [3, 9]
    assert request.output_token_ids == [2, 3, 9] and request.num_computed_tokens == 12
    assert [b.block_id for b in s.kv.blocks_of(request)] == [0, 1, 2]  # block 3 held only rejected drafts
    assert s.kv.pool.num_free_blocks == 16 - 3
    assert s.speculation.stats.num_proposed == 4 and s.speculation.stats.num_accepted == 1


def test_accepted_drafts_stop_at_max_tokens_and_stop_tokens():
    s = _scheduler(num_speculative_tokens=4)
    s.add_request(make_request("r", prompt=[1, 2, 3, 4, 5, 1], max_tokens=4, stop_token_ids=[4]))
    s.update_from_output(first := s.schedule(), ModelOutput(["r"], [2]))
    assert first.num_scheduled_tokens == {"r": 6}
    step = s.schedule()
    assert step.spec_token_ids == {"r": [3, 4]}  # max_tokens 4: two drafts and the target's token
    out = s.update_from_output(step, ModelOutput(["r"], [5], accepted_token_ids={"r": [3, 4]}))
    assert out[0].new_token_ids == [3, 4] and out[0].finished and out[0].stop_reason == 4
    assert s.kv.pool.num_free_blocks == 16


def test_a_saturated_batch_never_speculates():
    s = _scheduler(num_speculative_tokens=4, disable_by_batch_size=2)
    for rid in "ab":
        s.add_request(make_request(rid, prompt=[1, 2, 3, 1, 2], max_tokens=8))
    s.update_from_output(step := s.schedule(), ModelOutput(["a", "b"], [3, 3]))
    step = s.schedule()
    assert step.spec_token_ids == {} and step.num_scheduled_tokens == {"a": 1, "b": 1}


def test_suffix_proposes_the_most_frequent_continuation_while_confident():
    from batchserve.core.suffix_proposer import SuffixProposer

    proposer = SuffixProposer(max_depth=3, min_token_prob=0.4, max_cached_requests=2)
    # "1 2" was followed by 3 twice and by 4 once: 3 (confidence 2/3), then "1 2 3" -> 5 always (2/3), then
    # "2 3 5" -> 1 or 9 (2/3 * 1/2 = 1/3 < 0.4): stop
    assert proposer.propose_for("a", [1, 2, 3, 5, 1, 2, 4, 1, 2, 3, 5, 9, 1, 2], 4) == [3, 5]
    strict = SuffixProposer(max_depth=3, min_token_prob=0.7, max_cached_requests=2)
    assert strict.propose_for("a", [1, 2, 3, 5, 1, 2, 4, 1, 2, 3, 5, 9, 1, 2], 4) == []  # 2/3 < 0.7
    # another request's finished output is searched too, and leaves once more recent ones push it out
    proposer.finished("a", [7, 8, 9, 6])
    assert proposer.propose_for("b", [40, 7, 8], 2) == [9, 6]
    proposer.finished("c", [50, 51])
    proposer.finished("d", [52, 53])
    assert proposer.propose_for("e", [40, 7, 8], 2) == []
    assert set(proposer.own) == {"b", "e"}


def test_suffix_method_in_the_scheduler_learns_from_finished_requests():
    s = _scheduler(method="suffix", num_speculative_tokens=3)
    s.add_request(make_request("a", prompt=[1, 2], max_tokens=4))
    for token in (30, 31, 32, 33):
        s.update_from_output(s.schedule(), ModelOutput(["a"], [token]))
    assert "a" not in s.requests
    s.add_request(make_request("b", prompt=[5, 6], max_tokens=8))
    s.update_from_output(s.schedule(), ModelOutput(["b"], [30]))
    assert s.schedule().spec_token_ids == {"b": [31, 32, 33]}
