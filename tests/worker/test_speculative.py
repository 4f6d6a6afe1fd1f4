"""Verification of speculative drafts (worker/speculative.py): greedy keeps the longest prefix equal to the target's
argmax and adds the target's token; sampling keeps the target's distribution exactly (a chi-square bound on the first
and second emitted tokens, with drafts that are likely, unlikely and impossible), and a seeded request draws the same
tokens whatever shares its batch."""

from __future__ import annotations

import pytest
import torch

from batchserve.core.outputs import NewRequestData, SchedulerOutput
from batchserve.sampling_params import SamplingParams
from batchserve.worker.input_batch import RequestTable
from batchserve.worker.speculative import verify

VOCAB = 8
# the chi-square 99.9% quantile with VOCAB - 1 = 7 degrees of freedom: a correct sampler exceeds it once in 1000 runs
CHI2_7_999 = 24.32


def _table(params: list[SamplingParams], context=(1, 2, 3)) -> tuple[RequestTable, list[str]]:
    table = RequestTable(block_size=4)
    ids = [f"r{i}" for i in range(len(params))]
    news = [NewRequestData(rid, list(context), 2, p, [0], 3) for rid, p in zip(ids, params)]
    table.apply(SchedulerOutput(new_requests=news))
    return table, ids


def test_greedy_accepts_the_matching_prefix_and_adds_the_targets_token():
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    table, ids = _table([greedy, greedy, greedy])
    drafts = {"r0": [5, 6, 7], "r1": [5, 1, 7], "r2": [4]}
    targets = [5, 6, 7, 2, 5, 6, 7, 2, 5, 3]  # argmax of each of the 4 + 4 + 2 positions
    logits = torch.nn.functional.one_hot(torch.tensor(targets), VOCAB).float()
    result = verify(logits, table, ids, drafts, eos_token_ids=[0])
    assert result.accepted == {"r0": [5, 6, 7], "r1": [5], "r2": []}
    assert result.next_token == {"r0": 2, "r1": 6, "r2": 5}


def _chi_square(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft", [0, 3, 7])  # likely, unlikely, impossible under the target
def test_sampled_tokens_follow_the_target_distribution(draft):
    trials = 4000
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=10) for i in range(trials)]
    table, ids = _table(params)
    first = torch.tensor([2.0, 1.0, 0.5, -0.5, 0.0, 1.5, 0.3, float("-inf")])
    second = torch.tensor([0.0, 0.1, 2.0, 0.2, -1.0, 0.5, 1.0, 0.4])
    logits = torch.stack([first, second]).repeat(trials, 1)
    result = verify(logits, table, ids, {rid: [draft] for rid in ids}, eos_token_ids=[])
    p_first, p_second = (first / 0.7).softmax(-1), (second / 0.7).softmax(-1)
    emitted_first = [result.accepted[rid][0] if result.accepted[rid] else result.next_token[rid] for rid in ids]
    after_accept = [result.next_token[rid] for rid in ids if result.accepted[rid]]
    assert _chi_square(emitted_first, p_first) < CHI2_7_999
    if draft != 7:
        assert abs(len(after_accept) / trials - float(p_first[draft])) < 0.03
        assert _chi_square(after_accept, p_second) < CHI2_7_999
    else:
        assert not after_accept


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=10)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    alone_table, _ = _table([seeded])
    alone = verify(logits, alone_table, ["r0"], {"r0": [1, 2]}, eos_token_ids=[])
    other = SamplingParams(temperature=1.0, max_tokens=10)
    table, ids = _table([other, seeded])
    mixed = verify(torch.cat([logits, logits]), table, ids, {"r0": [1, 2], "r1": [1, 2]}, eos_token_ids=[])
    assert (alone.accepted["r0"], alone.next_token["r0"]) == (mixed.accepted["r1"], mixed.next_token["r1"])
