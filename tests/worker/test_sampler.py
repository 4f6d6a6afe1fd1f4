"""Sampler outcomes against straightforward per-row references (and transformers' own processors where it has them)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from batchserve.sampling_params import SamplingParams
from batchserve.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)

CPU = torch.device("cpu")
EOS = 0


def build(params, token_ids=None, num_prompt_tokens=None, vocab_size=32, eos_token_ids=(EOS,)):
    token_ids = token_ids if token_ids is not None else [[1, 2, 3] for _ in params]
    num_prompt_tokens = num_prompt_tokens if num_prompt_tokens is not None else [len(t) for t in token_ids]
    return SamplingMetadata.build(params, token_ids, num_prompt_tokens, list(eos_token_ids), vocab_size, CPU)


def sample(logits, params, **kw):
    return Sampler()(logits, build(params, vocab_size=logits.shape[-1], **kw))


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- greedy ---------------------------------------------------------------------------------------------------------


def test_all_greedy_is_a_bare_argmax():
    logits = randn(8, 1000)
    meta = build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 8, vocab_size=1000)
    # the flags that make this a single argmax: nothing else is built
    assert meta.all_greedy and meta.temperature is None and meta.top_k is None and meta.top_p is None
    assert meta.seen_mask is None and meta.output_counts is None and meta.min_tokens_mask is None
    out = Sampler()(logits, meta)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_with_repetition_penalty_matches_transformers():
    vocab, token_ids = 50, [[3, 7, 7, 11], [1, 2], [4, 9, 12, 12, 40]]
    logits = randn(3, vocab, seed=1) * 3
    for ids, row in zip(
        token_ids, logits, strict=True
    ):  # make the seen tokens the strong candidates, so the penalty decides
        row[ids] += 4.0
    out = sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.8)] * 3, token_ids=token_ids)
    hf = RepetitionPenaltyLogitsProcessor(penalty=1.8)
    for i, ids in enumerate(token_ids):
        expected = hf(torch.tensor([ids]), logits[i : i + 1].clone()).argmax(-1)
        assert out.token_ids[i].item() == expected.item()


def test_greedy_and_random_rows_mix():
    logits = randn(4, 100)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(),
    ]
    out = sample(logits, params)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_input_logits_are_not_modified():
    logits = randn(3, 40)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, min_tokens=2, logprobs=2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(seed=3),
    ]
    sample(logits, params, token_ids=[[1, 2, 5], [2, 2, 6], [7]], num_prompt_tokens=[2, 1, 1])
    assert torch.equal(logits, before)


# --- penalties ------------------------------------------------------------------------------------------------------


def reference_penalties(row, ids, num_prompt, p):
    row = row.clone()
    for t in set(ids):  # HF: over prompt + output
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    output = ids[num_prompt:]
    for t in set(output):  # OpenAI: over output only
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def test_penalties_match_per_row_reference():
    vocab = 30
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=0.7),
        SamplingParams(frequency_penalty=0.4),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.2),
        SamplingParams(),  # untouched in a batch that uses penalties
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=2.0),
    ]
    token_ids = [[1, 1, 2, 5, 5, 5], [3, 4, 4, 4, 9], [7, 8, 8, 8, 8, 2], [1, 2, 3, 1, 1, 2, 29], [4, 4, 4], [6]]
    num_prompt = [3, 2, 1, 4, 1, 1]
    logits = randn(len(params), vocab, seed=2) * 2
    meta = build(params, token_ids, num_prompt, vocab_size=vocab)
    got = apply_penalties(logits, meta)
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], token_ids[i], num_prompt[i], p))
    assert torch.equal(got[4], logits[4])


def test_no_penalty_tensors_without_penalties():
    meta = build([SamplingParams(temperature=0.5, top_k=3), SamplingParams(seed=1)])
    assert meta.seen_mask is None and meta.output_counts is None and meta.repetition_penalty is None
    assert meta.min_p is None and meta.top_p is None and meta.top_k is not None


# --- top_k / top_p / min_p ------------------------------------------------------------------------------------------


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = randn(64, 500, seed=3) * 2
    logits[0, 10] = logits[0, 20] = logits[0].max() + 1  # a tie: lowest id wins, like argmax
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=1, seed=5)):
        assert torch.equal(sample(logits, [p] * 64).token_ids, logits.argmax(-1))


def test_masks_match_transformers_warpers():
    logits = randn(16, 200, seed=4) * 3
    n = logits.shape[0]
    cases = [
        (apply_top_k_top_p(logits, torch.full((n, 1), 7), None), TopKLogitsWarper(7)),
        (apply_top_k_top_p(logits, None, torch.full((n, 1), 0.6)), TopPLogitsWarper(0.6)),
        (apply_min_p(logits, torch.full((n, 1), 0.05)), MinPLogitsWarper(0.05)),
    ]
    for ours, warper in cases:
        theirs = warper(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        kept = ~torch.isinf(ours)
        assert torch.equal(ours[kept], logits[kept])  # survivors untouched


def test_min_p_keeps_tokens_within_ratio_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.12, 0.1, 0.08]]))
    kept = ~torch.isinf(apply_min_p(logits, torch.tensor([[0.3]])))
    assert kept.tolist() == [[True, True, False, False, False]]  # 0.5 * 0.3 = 0.15
    tokens = sample(logits.expand(500, -1), [SamplingParams(min_p=0.3)] * 500).token_ids
    assert set(tokens.tolist()) == {0, 1}


# --- min_tokens -----------------------------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens():
    vocab = 10
    logits = torch.zeros(4, vocab)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0  # a stop token, the runner-up
    logits[:, 3] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5]),  # 1 output: both masked
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5]),  # 2 outputs: free again
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),  # eos masked even with ignore_eos
        SamplingParams(min_tokens=4, stop_token_ids=[5], seed=0),  # random row
    ]
    token_ids = [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3], [1, 2]]
    num_prompt = [2, 2, 2, 2]
    out = sample(logits, params, token_ids=token_ids, num_prompt_tokens=num_prompt, eos_token_ids=[EOS, 99])
    assert out.token_ids.tolist()[:3] == [3, EOS, 5]
    assert out.token_ids[3].item() not in (EOS, 5)


# --- logit_bias -----------------------------------------------------------------------------------------------------


def test_logit_bias_bans_and_forces_tokens_per_row_and_keeps_raw_logprobs():
    logits = randn(4, 50)
    top = logits.argmax(-1)
    runner_up = logits.topk(2, dim=-1).indices[:, 1]
    params = [
        SamplingParams(temperature=0.0, logit_bias={int(top[0]): -100.0}, logprobs=1),  # banned: the runner-up
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}),  # forced
        SamplingParams(temperature=0.0),  # no bias: untouched by the others'
        SamplingParams(temperature=0.0, logit_bias={int(top[3]): -1e-3}),  # a nudge too small to matter
    ]
    meta = build(params, vocab_size=50)
    assert meta.logit_bias is not None and meta.logit_bias[0][0].tolist() == [0, 1, 3]
    out = Sampler()(logits, meta)
    assert out.token_ids.tolist() == [int(runner_up[0]), 7, int(top[2]), int(top[3])]
    # logprobs stay the model's: the sampled runner-up's logprob is its raw one, rank 2
    raw = logits[0].log_softmax(-1)
    assert out.logprobs[0].rank == 2 and math.isclose(out.logprobs[0].logprob, raw[runner_up[0]].item(), rel_tol=1e-5)


def test_logit_bias_on_random_rows_changes_the_distribution():
    logits = torch.zeros(400, 8)  # uniform over 8 tokens
    banned = [SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0})] * 200
    forced = [SamplingParams(temperature=1.0, logit_bias={5: 100.0})] * 200
    out = Sampler()(logits, build(banned + forced, vocab_size=8)).token_ids.tolist()
    assert not {0, 1} & set(out[:200]) and len(set(out[:200])) > 3  # the rest still drawn
    assert set(out[200:]) == {5}


def test_logit_bias_is_skipped_when_unused_and_ignores_ids_past_the_vocabulary():
    assert build([SamplingParams(), SamplingParams(logit_bias={})]).logit_bias is None
    assert build([SamplingParams(logit_bias={40: 5.0})], vocab_size=32).logit_bias is None


@pytest.mark.parametrize(
    "bias", [{"3": 1.0}, {-1: 1.0}, {3: 101.0}, {3: math.nan}, {3: "1"}, [3, 1.0], {i: 1.0 for i in range(1025)}]
)
def test_logit_bias_is_validated(bias):
    from batchserve.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.param == "logit_bias"


# --- seeds ----------------------------------------------------------------------------------------------------------


def test_seeded_rows_independent_of_batch_composition_and_order():
    vocab = 1000
    target = SamplingParams(temperature=1.0, seed=1234)
    target_row = randn(vocab, seed=5)
    ids = [5, 6, 7, 8]

    def draw(others, position):
        params, logits, token_ids = list(others), [randn(vocab, seed=10 + i) for i in range(len(others))], []
        token_ids = [[1, 2, 3]] * len(others)
        params.insert(position, target)
        logits.insert(position, target_row)
        token_ids.insert(position, ids)
        out = sample(torch.stack(logits), params, token_ids=token_ids, num_prompt_tokens=[2] * len(params))
        return out.token_ids[position].item()

    alone = draw([], 0)
    torch.manual_seed(99)  # the shared RNG of unseeded rows must not matter
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=3, top_p=0.5, seed=7)]
    assert all(draw(others, pos) == alone for pos in range(4))
    torch.manual_seed(100)
    assert draw(others[::-1] + [SamplingParams(min_p=0.2, repetition_penalty=1.2)], 2) == alone


def test_seeded_request_replays_token_by_token_and_varies_per_step():
    # A flat distribution: the token is all noise, so equal draws at every step would mean the step isn't in the seed.
    vocab, prompt = 1000, [1, 2, 3]
    logits = torch.zeros(1, vocab)

    def generate(seed, steps=8):
        ids = list(prompt)
        for _ in range(steps):  # as after a recompute preemption: the state is just token_ids + num_prompt_tokens
            meta = build([SamplingParams(seed=seed)], token_ids=[ids], num_prompt_tokens=[3], vocab_size=vocab)
            ids.append(Sampler()(logits, meta).token_ids.item())
        return ids[3:]

    first = generate(42)
    assert generate(42) == first
    assert len(set(first)) > 4
    assert generate(43) != first


# --- distributions --------------------------------------------------------------------------------------------------


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Per-row textbook pipeline in float64: temperature, min_p, top_k, top_p, renormalize."""
    probs = (logits.double() / p.temperature).softmax(-1)
    keep = probs >= p.min_p * probs.max()
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    order = [i for i in order if keep[i]][: p.top_k if p.top_k > 0 else None]
    total, mass, kept = sum(probs[i].item() for i in order), 0.0, []
    for i in order:
        if mass >= p.top_p:
            break
        kept.append(i)
        mass += probs[i].item() / total
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


# 99.9% chi-square quantiles by degrees of freedom: a deterministic RNG can't flake, and a real bias still fails.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.5, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.2, min_p=0.08, top_k=6, top_p=0.9),
    ],
)
def test_unseeded_sampling_matches_softmax(params):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    torch.manual_seed(0)
    draws = 20_000
    tokens = sample(logits.expand(draws, -1), [params] * draws).token_ids
    probs = reference_probs(logits, params)
    stat = chi_square(torch.bincount(tokens, minlength=len(logits)).double(), probs)
    assert stat < CHI2_999[int((probs > 0).sum()) - 1]


def test_seeded_sampling_matches_softmax():
    logits = torch.tensor([1.0, 0.3, 0.0, -0.4, -2.0])
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(3000)]
    tokens = sample(logits.expand(len(params), -1), params).token_ids
    probs = reference_probs(logits, params[0])
    assert chi_square(torch.bincount(tokens, minlength=5).double(), probs) < CHI2_999[4]


# --- logprobs -------------------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_rank_and_top_k():
    vocab = 60
    logits = randn(4, vocab, seed=6) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, top_k=10, logprobs=5, seed=1, presence_penalty=1.0),
        SamplingParams(seed=2),  # did not ask
        SamplingParams(temperature=1.3, logprobs=0, seed=3),
    ]
    out = sample(logits, params, token_ids=[[1, 2, 3, 4]] * 4, num_prompt_tokens=[2] * 4)
    assert out.logprobs[2] is None
    raw = logits.log_softmax(-1)  # before penalties and temperature
    for i, k in ((0, 3), (1, 5), (3, 0)):
        lp, token = out.logprobs[i], out.token_ids[i].item()
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[i, token].item(), abs=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        values, ids = raw[i].topk(k)
        assert list(lp.top) == ids.tolist()
        assert list(lp.top.values()) == pytest.approx(values.tolist(), abs=1e-5)
    assert math.fsum(math.exp(v) for v in raw[0].tolist()) == pytest.approx(1.0)


def test_no_logprobs_when_no_row_asks():
    assert sample(randn(2, 20), [SamplingParams(), SamplingParams(temperature=0.0)]).logprobs is None


# --- property: the draw stays inside the allowed set ----------------------------------------------------------------


@st.composite
def sampling_case(draw):
    vocab = draw(st.integers(2, 40))
    logits = draw(st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=vocab, max_size=vocab))
    params = SamplingParams(
        temperature=draw(st.floats(0.1, 2.0)),
        top_k=draw(st.sampled_from([-1, 0]) | st.integers(1, vocab + 2)),
        top_p=draw(st.floats(0.01, 1.0)),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])),
        seed=draw(st.integers(0, 2**32)),
    )
    return torch.tensor(logits), params


def allowed_tokens(logits: torch.Tensor, p: SamplingParams, tol: float = 1e-4) -> set[int]:
    """A slightly generous reference set: ties at the k-th value all count, and boundaries get a tolerance."""
    probs = (logits.double() / p.temperature).softmax(-1)
    candidates = [i for i in range(len(probs)) if probs[i] >= p.min_p * probs.max() * (1 - tol)]
    candidates.sort(key=lambda i: -probs[i].item())
    if 0 < p.top_k < len(candidates):
        kth = probs[candidates[p.top_k - 1]]
        candidates = [i for i in candidates if probs[i] >= kth * (1 - tol)]
    total, mass, allowed = sum(probs[i].item() for i in candidates), 0.0, set()
    for i in candidates:
        if mass >= p.top_p + tol:
            break
        allowed.add(i)
        mass += probs[i].item() / total
    return allowed


@settings(max_examples=300, deadline=None, derandomize=True)
@given(sampling_case())
def test_sampled_token_is_inside_top_k_top_p_min_p(case):
    logits, params = case
    batch = torch.stack([logits, logits])
    unseeded = SamplingParams(**{**vars(params), "seed": None})
    tokens = sample(batch, [params, unseeded]).token_ids.tolist()
    allowed = allowed_tokens(logits, params)
    assert tokens[0] in allowed and tokens[1] in allowed
