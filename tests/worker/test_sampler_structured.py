"""The grammar mask as a step of the batched sampler, and the worker's per-sequence matchers (xgrammar) on the
default model's vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from batchserve.sampling_params import ConstraintKind, InvalidRequestError, SamplingParams, StructuredOutputsParams
from batchserve.worker.sampler import Sampler, SamplingMetadata
from batchserve.worker.structured_output import StructuredOutputs, check_schema_keywords

CPU = torch.device("cpu")


def bitmask_allowing(rows: list[list[int] | None], vocab: int) -> torch.Tensor:
    """None: every token allowed."""
    mask = torch.zeros(len(rows), -(-vocab // 32), dtype=torch.int32)
    for r, allowed in enumerate(rows):
        for t in allowed if allowed is not None else range(vocab):
            bit = t % 32
            mask[r, t // 32] |= (1 << bit) if bit < 31 else -(1 << 31)
    return mask


def test_the_mask_decides_greedy_and_random_rows_and_logprobs_stay_raw():
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    mask = bitmask_allowing([[5, 63], None, [31, 95]], vocab)
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0), SamplingParams(seed=3)]
    meta = SamplingMetadata.build(params, [[1]] * 3, [1] * 3, [0], vocab, CPU, token_bitmask=mask)
    out = Sampler()(logits, meta)
    expected_first = 5 if logits[0, 5] > logits[0, 63] else 63
    assert out.token_ids[0].item() == expected_first
    assert out.token_ids[1].item() == logits[1].argmax().item()  # a free row in a constrained batch is untouched
    assert out.token_ids[2].item() in (31, 95)
    assert out.logprobs[0].logprob == pytest.approx(logits[0].log_softmax(-1)[expected_first].item(), abs=1e-5)


@pytest.fixture(scope="module")
def tokenizer():
    from batchserve.models.loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path(), None)


def constrained_decode(structured: StructuredOutputs, req_id: str, steps: int, eos: int) -> list[int]:
    """Greedy over constant random logits: only the mask steers, as the worst model would."""
    logits = torch.randn(1, structured.vocab_size, generator=torch.Generator().manual_seed(1))
    out: list[int] = []
    for _ in range(steps):
        mask = structured.fill_masks([req_id])
        meta = SamplingMetadata.build([SamplingParams(temperature=0.0)], [[1]], [1], [eos], structured.vocab_size,
                                      CPU, token_bitmask=mask)  # fmt: skip
        token = Sampler()(logits.clone(), meta).token_ids.tolist()  # masked in place
        structured.accept([req_id], token)
        if token[0] == eos:
            return out
        out += token
    raise AssertionError("the grammar never ended")


def test_a_regex_and_a_choice_end_with_eos(tokenizer):
    eos = tokenizer.eos_token_id
    structured = StructuredOutputs(len(tokenizer), [eos], tokenizer)
    structured.add("a", StructuredOutputsParams(ConstraintKind.REGEX, "[0-9]{3}-[a-c]{2}"))
    structured.add("b", StructuredOutputsParams(ConstraintKind.CHOICE, json.dumps(["yes", "no"])))
    import re

    assert re.fullmatch("[0-9]{3}-[a-c]{2}", tokenizer.decode(constrained_decode(structured, "a", 20, eos)))
    assert tokenizer.decode(constrained_decode(structured, "b", 5, eos)) in ("yes", "no")
    assert structured.fill_masks(["free"]) is None


def test_a_recomputed_request_replays_its_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    structured = StructuredOutputs(len(tokenizer), [eos], tokenizer)
    constraint = StructuredOutputsParams(ConstraintKind.CHOICE, json.dumps(["abcdefgh", "xyz"]))
    prefix = tokenizer.encode("abc", add_special_tokens=False)
    structured.add("r", constraint, prefix)
    rest = constrained_decode(structured, "r", 10, eos)
    assert tokenizer.decode(prefix + rest) == "abcdefgh"


@pytest.mark.parametrize(
    "schema, word",
    [({"type": "object", "if": {}}, "if"), ({"properties": {"a": {"not": {}}}}, "not"),
     ({"items": {"uniqueItems": True}}, "uniqueItems"), ({"$defs": {"x": {"multipleOf": 2}}}, "multipleOf")],
)  # fmt: skip
def test_keywords_the_grammar_cannot_enforce_are_refused(schema, word):
    with pytest.raises(InvalidRequestError, match=word):
        check_schema_keywords(schema)


def test_a_mask_started_in_the_worker_thread_is_the_one_filled_in_place(tokenizer):
    eos = tokenizer.eos_token_id
    structured = StructuredOutputs(len(tokenizer), [eos], tokenizer, overlap=True)
    structured.add("a", StructuredOutputsParams(ConstraintKind.REGEX, "[0-9]{3}-[a-c]{2}"))
    structured.add("b", StructuredOutputsParams(ConstraintKind.CHOICE, json.dumps(["yes", "no"])))
    rows = ["a", "free", "b"]
    structured.start_fill(rows)
    assert structured._pending is not None  # started, in the worker thread
    assert torch.equal(structured.masks(rows), structured.fill_masks(rows))
    structured.start_fill(rows)
    assert torch.equal(structured.masks(["b", "a"]), structured.fill_masks(["b", "a"]))  # other rows: filled now
    before = structured.fill_masks(rows)
    structured.start_fill(rows)
    (digit,), (y,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("1", "y"))
    structured.accept(rows, [digit, 0, y])  # the matchers move on: the started fill is stale, not used
    after = structured.masks(rows)
    assert torch.equal(after, structured.fill_masks(rows)) and not torch.equal(after[2], before[2])
    structured.start_fill(["free"])  # no constrained row: nothing started
    assert structured._pending is None
    structured.close()
    assert structured._filler is None


def test_with_overlap_off_nothing_is_started(tokenizer):
    structured = StructuredOutputs(len(tokenizer), [tokenizer.eos_token_id], tokenizer, overlap=False)
    structured.add("a", StructuredOutputsParams(ConstraintKind.REGEX, "[0-9]+"))
    structured.start_fill(["a"])
    assert structured._pending is None and structured._filler is None
    assert structured.masks(["a"]) is not None


def test_the_worker_thread_runs_no_torch_operator(tokenizer):
    """A torch operator in the fill thread (allocating a batch-64 bitmask is one big enough to go parallel) would
    start a second OpenMP team there: every operator of the model would pay for it. The fill thread is the only
    thread an overlapped fill adds."""
    import os

    if torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"):
        pytest.skip("one torch thread (no OpenMP team to start), or no /proc to count threads in")
    structured = StructuredOutputs(len(tokenizer), [tokenizer.eos_token_id], tokenizer, overlap=True)
    rows = [str(i) for i in range(64)]
    for r in rows:
        structured.add(r, StructuredOutputsParams(ConstraintKind.REGEX, "[0-9]+"))
    structured.start_fill(rows[:1])
    structured.masks(rows[:1])  # the fill thread exists from here on
    torch.ones(1 << 20).sum()  # and this thread's OpenMP team (the stepping thread has one)
    before = len(os.listdir("/proc/self/task"))
    structured.start_fill(rows)
    assert structured.masks(rows) is not None
    assert len(os.listdir("/proc/self/task")) == before
    structured.close()
