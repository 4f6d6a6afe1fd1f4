"""The speculation workloads as `bench` names: code-edit, extract-json, summarize-quote and multi-turn are
chat requests built from text that ships with the package, through the tokenizer's chat template, stopping at their
end of sequence unless the flags say otherwise."""

from __future__ import annotations

import pytest

from batchserve.bench import cli
from batchserve.bench.args import make_requests
from batchserve.bench.repetitive import REPETITIVE_WORKLOADS, conversations
from batchserve.bench.workloads import WORKLOADS, WorkloadOptions, make_workload
from batchserve.serving.chat import chat_prompt_ids


@pytest.mark.parametrize("name", REPETITIVE_WORKLOADS)
def test_each_is_a_bench_workload_of_chat_prompts(tokenizer, name):
    assert name in WORKLOADS
    requests = make_workload(name, tokenizer, 20, options=WorkloadOptions(output_len=48))
    convs = conversations(name, 20)
    assert len(requests) == 20 and {r.category for r in requests} == {name}
    assert all(r.output_len == 48 and not r.ignore_eos for r in requests)
    assert [r.prompt_token_ids for r in requests] == [chat_prompt_ids(tokenizer, c) for c in convs]
    assert len({tuple(r.prompt_token_ids) for r in requests}) > 1  # not one prompt repeated


def test_the_prompts_hold_the_text_the_answer_should_repeat(tokenizer):
    edit = conversations("code-edit", 3)[0][0]["content"]
    assert "Output only the code" in edit and "\ndef " in "\n" + edit.split("\n\n", 1)[1]
    turns = conversations("multi-turn", 2)[1]
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[1]["content"] in turns[0]["content"]  # the assistant's answer is the paragraph it was shown


def test_more_requests_than_texts_reuse_them_in_turn():
    many = conversations("summarize-quote", 40)
    assert len(many) == 40 and many[0] == many[len({c[0]["content"] for c in many})]


def test_an_unknown_name_and_a_bench_run_that_forces_ignore_eos(tokenizer):
    with pytest.raises(ValueError, match="code-edit"):
        conversations("code-review", 1)
    natural = cli.build_parser().parse_args(["--offline", "--workload", "extract-json"])
    forced = cli.build_parser().parse_args(["--offline", "--workload", "extract-json", "--ignore-eos"])
    for args in (natural, forced):
        cli.normalize(args)
    assert not any(r.ignore_eos for r in make_requests(natural, tokenizer, 3, 0))
    assert all(r.ignore_eos for r in make_requests(forced, tokenizer, 3, 0))
