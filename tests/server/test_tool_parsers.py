"""Tool-call and reasoning parsers, model-free: whole outputs, and streams fed in every possible cut whose
assembly equals the whole."""

from __future__ import annotations

import json

import pytest

from batchserve.entrypoints.openai.chat_output import ChatOutputFormat
from batchserve.serving.reasoning import REASONING_PARSERS
from batchserve.serving.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    parser_for,
)
from batchserve.serving.tools import tool_request

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]  # fmt: skip

CASES = [
    (HermesToolParser(), 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
     '{"name": "g", "arguments": {}}\n</tool_call>', "Sure.", [("f", {"x": 1}), ("g", {})]),
    (HermesToolParser(), "no call here", "no call here", []),
    (HermesToolParser(), "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}',
     None, [("f", {"x": 2}), ("g", {})]),
    (Llama3JsonToolParser(), "Hello there", "Hello there", []),
    (MistralToolParser(), '[TOOL_CALLS][{"name": "f", "arguments": {"y": "z"}}]', None, [("f", {"y": "z"})]),
    (MistralToolParser(), "plain", "plain", []),
]  # fmt: skip


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_outputs(parser, text, content, calls):
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streams_assemble_to_the_whole(parser, text, content, calls, piece):
    fmt = ChatOutputFormat(tool_request(TOOLS, "auto", None), parser)
    stream = fmt.stream()
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    deltas = [d for i, p in enumerate(pieces) for d in stream.delta(p, i == len(pieces) - 1)]
    streamed_content = "".join(d.get("content", "") for d in deltas)
    names = "".join(d["tool_calls"][0]["function"].get("name", "") for d in deltas if "tool_calls" in d)
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
    whole, _ = fmt.message(text, "stop")
    if calls:
        assert names == "".join(c["function"]["name"] for c in whole["tool_calls"])
        assert arguments == "".join(c["function"]["arguments"] for c in whole["tool_calls"])
        assert streamed_content.strip() == (whole["content"] or "")
    else:
        assert streamed_content == whole["content"] == text


def test_the_parser_follows_the_template_or_the_flag():
    assert parser_for(None, "...[TOOL_CALLS]...").name == "mistral"
    assert parser_for(None, "<|python_tag|>").name == "llama3_json"
    assert parser_for(None, "<|im_start|>").name == "hermes"
    assert parser_for("mistral", "<|im_start|>").name == "mistral"
    with pytest.raises(ValueError, match="unknown"):
        parser_for("nope", None)


@pytest.mark.parametrize(
    "name, text, reasoning, content",
    [
        ("qwen3", "<think>\nhmm, 2+2</think>\n\nIt is 4.", "\nhmm, 2+2", "It is 4."),
        ("qwen3", "It is 4.", None, "It is 4."),
        ("deepseek_r1", "let me see</think>4", "let me see", "4"),
        ("deepseek_r1", "still thinking", "still thinking", None),
    ],
)
@pytest.mark.parametrize("piece", [1, 2, 5, 100])
def test_reasoning_whole_and_streamed(name, text, reasoning, content, piece):
    fmt = ChatOutputFormat(reasoning=REASONING_PARSERS[name])
    message, _ = fmt.message(text, "stop")
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    stream = fmt.stream()
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    deltas = [d for i, p in enumerate(pieces) for d in stream.delta(p, i == len(pieces) - 1)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == (content or "")


@pytest.fixture(scope="module")
def tokenizer():
    from batchserve.models.loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path(), None)


def test_the_shipped_template_renders_plain_chats_as_the_models_own(tokenizer):
    from batchserve.serving.tools import render_chat, shipped_template

    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "?"},
    ]
    own = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert render_chat(tokenizer, chat, None, shipped_template("chatml_tools"), None, True) == list(own)


def test_tools_and_template_kwargs_reach_the_template(tokenizer):
    from batchserve.serving.tools import render_chat

    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    text = tokenizer.decode(render_chat(tokenizer, chat, tool_request(TOOLS, "auto", None), None, None, True))
    assert '<tools>\n{"type": "function", "function": {"name": "f"' in text
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    template = "{{ 'T' if enable_thinking else 'F' }}{{ messages[0]['content'] }}"
    rendered = render_chat(tokenizer, chat[:1], None, template, {"enable_thinking": True}, True)
    assert tokenizer.decode(rendered) == "Tweather?"
