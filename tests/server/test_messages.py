"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic client: on the model-free engine
(fast: layout, stream events, errors, x-api-key) and on SmolLM2 (slow: a tool_use / tool_result round trip)."""

from __future__ import annotations

import httpx
import pytest

from tests.lazy import anthropic, openai
from tests.server.fakes import fake_engine
from tests.server.live import start_server

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def fake_server():
    server = start_server(fake_engine(delay_s=0.001), api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(fake_server):
    return httpx.get(fake_server.url + "/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def claude(fake_server):
    return anthropic.Anthropic(base_url=fake_server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def gpt(fake_server):
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key=KEY, max_retries=0)


def test_greedy_text_equals_the_chat_completion_of_the_same_conversation(model, claude, gpt):
    message = claude.messages.create(
        model=model, max_tokens=10, system="Be brief.", extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
                  {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Go on"}],
    )  # fmt: skip
    chat = gpt.chat.completions.create(
        model=model, max_tokens=10, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                  {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Go on"}],
    )  # fmt: skip
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content and len(block.text) == 10
    assert message.stop_reason == "max_tokens" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.usage.input_tokens == chat.usage.prompt_tokens and message.usage.output_tokens == 10


def test_stream_sends_anthropics_event_sequence_and_assembles_to_the_whole_message(fake_server, model, claude):
    args = dict(model=model, max_tokens=8, messages=[{"role": "user", "content": "Stream this"}])
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    raw = httpx.post(fake_server.url + "/v1/messages", json={**args, "stream": True}, headers={"x-api-key": KEY})
    names = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * 8, "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    assert "message_start" in kinds and "message_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens == whole.usage.input_tokens


def test_stop_sequences_end_the_turn_and_are_named(model, claude):
    free = claude.messages.create(model=model, max_tokens=12,
                                  messages=[{"role": "user", "content": "Say something"}])  # fmt: skip
    stop = free.content[0].text[4:6]
    cut = claude.messages.create(model=model, max_tokens=12, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": "Say something"}])  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free.content[0].text[: free.content[0].text.index(stop)]


def test_count_tokens_equals_the_prompt_the_message_uses(model, claude):
    messages = [{"role": "user", "content": "Count me"}]
    counted = claude.messages.count_tokens(model=model, system="sys", messages=messages)
    sent = claude.messages.create(model=model, system="sys", messages=messages, max_tokens=1)
    assert counted.input_tokens == sent.usage.input_tokens > 0


def test_api_key_is_read_from_x_api_key(fake_server, model):
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(fake_server.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"}).status_code == 401
    assert httpx.post(fake_server.url + "/v1/messages", json=body).status_code == 401
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=fake_server.url, api_key="wrong", max_retries=0).messages.create(**body)


@pytest.mark.parametrize(
    "change, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]},
         "messages[0].content[0].input"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
         "messages[0].content[0].tool_use_id"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"system": [{"type": "image"}]}, "system[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "regex"}}}, "output_config.format.type"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": 5}}}}, "output_config.format.schema"),
    ],
)  # fmt: skip
def test_malformed_requests_are_400s_in_anthropics_shape_naming_the_field(fake_server, model, change, param):
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]} | change
    body = {k: v for k, v in body.items() if v is not None}
    answer = httpx.post(fake_server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"].startswith(param) and param in error["error"]["message"], error


def test_unknown_model_is_a_404(fake_server):
    body = {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    answer = httpx.post(fake_server.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------- on SmolLM2 (tool calls)

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}  # fmt: skip


@pytest.mark.slow
def test_tool_use_and_tool_result_round_trip(real_server):
    claude = anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0)
    model = real_server.model_id()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model=model, max_tokens=60, extra_body={"temperature": 0}, messages=ask, tools=[WEATHER],
                                   tool_choice={"type": "any"})  # fmt: skip
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    with claude.messages.stream(model=model, max_tokens=60, extra_body={"temperature": 0}, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"}) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    [streamed_use] = [block for block in streamed.content if block.type == "tool_use"]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"
    follow_up = ask + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, clear sky"}]},
    ]
    second = claude.messages.create(
        model=model, max_tokens=16, extra_body={"temperature": 0}, messages=follow_up, tools=[WEATHER]
    )
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.usage.input_tokens > first.usage.input_tokens


def test_content_blocks_lay_out_thinking_text_and_tool_use_in_order():
    from batchserve.entrypoints.openai.messages import ContentBlocks
    from batchserve.entrypoints.openai.turns import Piece

    blocks = ContentBlocks()
    pieces = [Piece("reasoning", "hmm"), Piece("text", "Let me look."), Piece("call", call_id="t1", name="f"),
              Piece("arguments", '{"a": '), Piece("arguments", "1}")]  # fmt: skip
    events = [e for piece in pieces for e in blocks.feed(piece)] + blocks.close()
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2), ("content_block_stop", 2),
    ]  # fmt: skip
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "text_delta", "input_json_delta", "input_json_delta"]  # fmt: skip
    assert blocks.content() == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                {"type": "text", "text": "Let me look."},
                                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]  # fmt: skip


@pytest.mark.slow
def test_greedy_text_equals_chat_on_smollm2_whole_and_streamed(real_server, client):
    claude = anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0)
    model = real_server.model_id()
    ask = [{"role": "user", "content": "What colour is the sky?"}]
    args = dict(model=model, max_tokens=40, system="Answer in one short sentence.", messages=ask,
                extra_body={"temperature": 0})  # fmt: skip
    whole = claude.messages.create(**args)
    chat = client.chat.completions.create(
        model=model, max_tokens=40, temperature=0,
        messages=[{"role": "system", "content": "Answer in one short sentence."}, *ask],
    )  # fmt: skip
    assert whole.content[0].text == chat.choices[0].message.content
    assert whole.stop_reason == ("end_turn" if chat.choices[0].finish_reason == "stop" else "max_tokens")
    with claude.messages.stream(**args) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text
        assert stream.get_final_message().usage.output_tokens == whole.usage.output_tokens
