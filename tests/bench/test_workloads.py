import json
import math
import statistics

import pytest

from batchserve.bench.corpus import CORPUS
from batchserve.bench.workloads import WorkloadOptions, describe, make_workload


def test_uniform_lengths(tokenizer):
    reqs = make_workload("uniform", tokenizer, 200, seed=0, options=WorkloadOptions(input_len=64))
    assert all(r.prompt_len == 64 for r in reqs)
    outs = [r.output_len for r in reqs]
    assert min(outs) >= 80 and max(outs) <= 120
    assert statistics.mean(outs) == pytest.approx(100, abs=3)
    assert len({r.request_id for r in reqs}) == 200


def test_reproducible_from_seed(tokenizer):
    a = make_workload("uniform", tokenizer, 20, seed=7)
    b = make_workload("uniform", tokenizer, 20, seed=7)
    c = make_workload("uniform", tokenizer, 20, seed=8)
    assert [(r.prompt_token_ids, r.output_len) for r in a] == [(r.prompt_token_ids, r.output_len) for r in b]
    assert [r.output_len for r in a] != [r.output_len for r in c]


def test_prompts_are_real_text_without_shared_prefixes(tokenizer):
    reqs = make_workload("uniform", tokenizer, 30, seed=0, options=WorkloadOptions(input_len=40))
    text = tokenizer.decode(reqs[0].prompt_token_ids)  # the byte tokenizer: one token per character of the prose
    assert len(text) == 40 and any(w.isalpha() and len(w) > 3 for w in text.split())
    firsts = {tuple(r.prompt_token_ids[:8]) for r in reqs}  # the unique header ("[0-12] ") keeps first blocks apart
    assert len(firsts) == 30


def test_long_prompt_wraps_the_corpus(tokenizer):
    corpus_len = len(tokenizer.encode(" ".join(CORPUS.split()), add_special_tokens=False))
    n = corpus_len + 800  # longer than the whole corpus: the prompt must wrap around
    reqs = make_workload("uniform", tokenizer, 2, seed=0, options=WorkloadOptions(input_len=n))
    assert [r.prompt_len for r in reqs] == [n, n]


def test_mixed_lengths_and_ratio(tokenizer):
    reqs = make_workload("mixed", tokenizer, 50, seed=1, options=WorkloadOptions(long_ratio=0.3))
    longs = [r for r in reqs if r.category == "long"]
    shorts = [r for r in reqs if r.category == "short"]
    assert len(longs) == 15 and len(shorts) == 35
    assert all(r.prompt_len == 2000 and r.output_len == 500 for r in longs)
    assert all(r.prompt_len == 50 and r.output_len == 100 for r in shorts)
    assert reqs[0].category != reqs[-1].category or len({r.category for r in reqs[:10]}) == 2  # shuffled


def test_longtail_is_lognormal(tokenizer):
    opt = WorkloadOptions(output_len=100, sigma=0.8, max_output_len=4000)
    outs = sorted(r.output_len for r in make_workload("longtail", tokenizer, 1000, seed=2, options=opt))
    assert statistics.median(outs) == pytest.approx(100, rel=0.12)
    assert outs[-1] > 3 * statistics.median(outs)  # a long tail
    assert statistics.mean(outs) > 1.2 * statistics.median(outs)  # skewed right
    assert statistics.stdev(math.log(o) for o in outs) == pytest.approx(0.8, rel=0.1)
    assert (
        max(
            make_workload("longtail", tokenizer, 300, seed=2, options=WorkloadOptions(max_output_len=150)),
            key=lambda r: r.output_len,
        ).output_len
        <= 150
    )


def test_shared_prefix(tokenizer):
    opt = WorkloadOptions(prefix_len=300, input_len=40, output_len=20)
    reqs = make_workload("shared-prefix", tokenizer, 10, seed=3, options=opt)
    assert all(r.prompt_len == 340 and r.output_len == 20 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:300]) for r in reqs}) == 1
    assert len({tuple(r.prompt_token_ids[300:]) for r in reqs}) == 10


def test_sharegpt_file(tokenizer, tmp_path):
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"question number {i} " + "word " * (5 + i)},
                {"from": "gpt", "value": "answer " * (10 + i)},
            ]
        }
        for i in range(20)
    ] + [{"conversations": [{"from": "human", "value": "too short"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    reqs = make_workload("sharegpt", tokenizer, 12, seed=0, options=WorkloadOptions(dataset=str(path)))
    assert len(reqs) == 12
    for r in reqs:  # the byte tokenizer: one token per character
        i = int(r.prompt_text.split()[2])
        assert r.prompt_len == len(f"question number {i} ") + len("word ") * (5 + i)
        assert r.output_len == len("answer ") * (10 + i)
    with pytest.raises(ValueError, match="usable"):
        make_workload("sharegpt", tokenizer, 50, options=WorkloadOptions(dataset=str(path)))


def test_errors_and_describe(tokenizer):
    with pytest.raises(ValueError):
        make_workload("nope", tokenizer, 3)
    with pytest.raises(ValueError):
        make_workload("sharegpt", tokenizer, 3)
    d = describe(
        make_workload("uniform", tokenizer, 10, options=WorkloadOptions(input_len=8, output_len=10, spread=0.0))
    )
    assert d["total_output_tokens"] == 100 and d["mean_input_len"] == 8
