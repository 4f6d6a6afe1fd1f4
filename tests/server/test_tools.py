"""Tool calling end to end on SmolLM2-135M-Instruct with the shipped ChatML tools template: the official openai
client, tool_choice required / named (enforced by the grammar), auto, history with tool calls and tool results."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"]}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _assemble(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_assembles_to_the_non_streamed_one(real_server, client, tool_choice):
    args = dict(model=real_server.model_id(), messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80,
                temperature=0, parallel_tool_calls=False)  # fmt: skip
    full = client.chat.completions.create(**args).choices[0]
    assert full.finish_reason == "tool_calls" and len(full.message.tool_calls) == 1
    call = full.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "get_time") and "city" in arguments
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather" and arguments["unit"] in ("c", "f")
    streamed, finish = _assemble(client.chat.completions.create(stream=True, **args))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]
    assert streamed[0]["id"].startswith("call_")


def test_history_with_tool_calls_and_tool_results_renders(real_server, client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]  # fmt: skip
    out = client.chat.completions.create(model=real_server.model_id(), messages=messages, tools=TOOLS, max_tokens=24,
                                         temperature=0)  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_tool_choice_none_and_auto_answer(real_server, client):
    for choice in ("none", "auto"):
        out = client.chat.completions.create(model=real_server.model_id(), messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=16, temperature=0)  # fmt: skip
        message = out.choices[0].message
        assert message.content or message.tool_calls
        if choice == "none":
            assert not message.tool_calls


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"messages": [{"role": "tool", "tool_calls": [{"function": True}]}]}, "messages.0"),  # found by the fuzzer
        ({"messages": [{"role": "assistant", "tool_calls": ["f"]}]}, "messages.0.tool_calls.0"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(real_server, body, param):
    body = {"messages": ASK, "max_tokens": 2, **body}
    r = httpx.post(real_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_parser_splits_reasoning_content_in_whole_and_streamed_answers(real_server, client):
    front = real_server.app.state.front
    front.reasoning_parser = "deepseek_r1"  # SmolLM2 never closes a <think>: all of its output is reasoning
    try:
        args = dict(model=real_server.model_id(), messages=ASK, max_tokens=8, temperature=0)
        whole = client.chat.completions.create(**args).choices[0].message
        reasoning = whole.model_extra["reasoning_content"]
        assert reasoning and whole.content is None
        streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                           for c in client.chat.completions.create(stream=True, **args) if c.choices)  # fmt: skip
        assert streamed == reasoning
    finally:
        front.reasoning_parser = None
