"""POST /v1/responses through the official openai client: on the model-free engine (fast: layout, events, store,
errors) and on SmolLM2 (slow: structured output into a pydantic model, a function-call round trip)."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, Field

from batchserve.entrypoints.openai.response_store import ResponseStore
from tests.lazy import openai
from tests.server.fakes import fake_engine
from tests.server.live import start_server


@pytest.fixture(scope="module")
def fake_server():
    server = start_server(fake_engine(delay_s=0.001))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fake_client(fake_server):
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="unused", max_retries=0)


def test_greedy_text_equals_the_chat_completion_of_the_same_conversation(fake_server, fake_client):
    model = fake_server.model_id()
    response = fake_client.responses.create(model=model, instructions="Be brief.", input="Hello there",
                                            max_output_tokens=12, temperature=0)  # fmt: skip
    chat = fake_client.chat.completions.create(
        model=model, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content and len(response.output_text) == 12
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 12 and response.usage.total_tokens == chat.usage.total_tokens
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")


def test_input_items_render_as_the_same_chat_messages(fake_server, fake_client):
    model = fake_server.model_id()
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name "},
                                                        {"type": "input_text", "text": "a colour"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "blue"}]},
        {"role": "user", "content": "Another"},
    ]  # fmt: skip
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour"},
                {"role": "assistant", "content": "blue"}, {"role": "user", "content": "Another"}]  # fmt: skip
    response = fake_client.responses.create(model=model, input=items, max_output_tokens=6, temperature=0)
    chat = fake_client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert response.output_text == chat.choices[0].message.content


def test_stream_sends_the_typed_event_sequence_and_assembles_to_the_whole_response(fake_server, fake_client):
    args = dict(model=fake_server.model_id(), input="Stream this", max_output_tokens=8, temperature=0)
    whole = fake_client.responses.create(**args)
    with fake_client.responses.stream(**args) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 8, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text == events[-4].text
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert final.output[0].id == events[2].item.id == events[-2].item.id
    assert final.usage.output_tokens == 8


def test_previous_response_id_continues_the_stored_conversation(fake_server, fake_client):
    model = fake_server.model_id()
    first = fake_client.responses.create(model=model, input="First question", max_output_tokens=5, temperature=0)
    second = fake_client.responses.create(model=model, input="Second question", previous_response_id=first.id,
                                          max_output_tokens=5, temperature=0)  # fmt: skip
    messages = [{"role": "user", "content": "First question"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Second question"}]  # fmt: skip
    chat = fake_client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    assert fake_client.responses.retrieve(first.id).output_text == first.output_text
    fake_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        fake_client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        fake_client.responses.create(model=model, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert gone.value.body["param"] == "previous_response_id"
    unstored = fake_client.responses.create(model=model, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        fake_client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": -1.0}, "temperature"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": 3}, "input"),
    ],
)  # fmt: skip
def test_malformed_requests_are_400s_naming_the_field(fake_server, body, param):
    answer = httpx.post(fake_server.url + "/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"].startswith(param), answer.json()


def test_unknown_previous_response_id_is_a_404(fake_server):
    answer = httpx.post(fake_server.url + "/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "previous_response_id"
    assert httpx.delete(fake_server.url + "/v1/responses/resp_nope").status_code == 404


def test_store_is_bounded_by_size_and_age():
    now = [0.0]
    store = ResponseStore(max_responses=2, ttl_s=10.0, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.put(name, {"id": name}, [])
        now[0] += 1
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    now[0] = 11.5  # b was stored at 1, c at 2
    assert store.get("b") is None and store.get("c") is not None
    now[0] = 12.0
    assert store.get("c") is None and len(store) == 0
    assert not store.delete("c")


# ---------------------------------------------------------------- on SmolLM2 (structured output and tool calls)

TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"], "additionalProperties": False}}]  # fmt: skip


class City(BaseModel):
    name: str = Field(max_length=16)
    population: int = Field(ge=0, le=10_000_000)
    coastal: bool


@pytest.mark.slow
def test_parse_into_a_pydantic_model(real_server, client):
    response = client.responses.parse(model=real_server.model_id(), input="Describe a city as JSON.",
                                      text_format=City, max_output_tokens=64, temperature=0)  # fmt: skip
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)


@pytest.mark.slow
def test_function_call_round_trip_with_previous_response_id(real_server, client):
    model = real_server.model_id()
    first = client.responses.create(model=model, input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice="required", max_output_tokens=60, temperature=0)  # fmt: skip
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments) and call.call_id.startswith("call_")
    with client.responses.stream(model=model, input="What is the weather in Paris?", tools=TOOLS,
                                 tool_choice="required", max_output_tokens=60, temperature=0) as stream:  # fmt: skip
        events = list(stream)
        streamed = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.name == "get_weather"
    assert [i.type for i in streamed.output] == ["function_call"]
    second = client.responses.create(
        model=model, previous_response_id=first.id, tools=TOOLS, max_output_tokens=16, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}],
    )  # fmt: skip
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage.input_tokens > first.usage.input_tokens


def test_output_items_lay_out_reasoning_text_and_calls_in_order():
    from batchserve.entrypoints.openai.responses import OutputItems
    from batchserve.entrypoints.openai.turns import Piece

    items = OutputItems()
    pieces = [Piece("reasoning", "think "), Piece("reasoning", "more"), Piece("text", "Hi"), Piece("text", "!"),
              Piece("call", call_id="call_1", name="f"), Piece("arguments", '{"a": '), Piece("arguments", "1}")]  # fmt: skip
    events = [e for piece in pieces for e in items.feed(piece)] + items.close()
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
    ]  # fmt: skip
    reasoning, message, call = items.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "think more"}
    ]
    assert message["content"][0]["text"] == "Hi!" and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "f", '{"a": 1}')
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"  # a snapshot
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert items.turn.chat_message() == {"role": "assistant", "content": "Hi!", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}  # fmt: skip


@pytest.mark.slow
def test_greedy_text_equals_chat_on_smollm2_whole_and_streamed(real_server, client):
    model = real_server.model_id()
    args = dict(model=model, instructions="Answer in one short sentence.", input="What colour is the sky?",
                max_output_tokens=40, temperature=0)  # fmt: skip
    whole = client.responses.create(**args)
    chat = client.chat.completions.create(
        model=model, max_tokens=40, temperature=0,
        messages=[{"role": "system", "content": "Answer in one short sentence."},
                  {"role": "user", "content": "What colour is the sky?"}],
    )  # fmt: skip
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    with client.responses.stream(**args) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == whole.output_text


def test_reasoning_streamed_in_pieces_assembles_to_the_whole_turn():
    from types import SimpleNamespace

    from batchserve.entrypoints.openai.chat_output import ChatOutputFormat
    from batchserve.entrypoints.openai.responses import OutputItems
    from batchserve.entrypoints.openai.turns import TurnStream, whole_pieces
    from batchserve.serving.reasoning import reasoning_parser

    output = ChatOutputFormat(reasoning=reasoning_parser("qwen3"))
    chunks = ["<thi", "nk>weigh ", "it</th", "ink>\n\nThe ", "answer"]
    streamed, turn = OutputItems(), TurnStream(output)
    for i, chunk in enumerate(chunks):
        result = SimpleNamespace(delta=SimpleNamespace(delta_text=chunk), finished=i == len(chunks) - 1)
        for piece in turn.feed(result):
            streamed.feed(piece)
    streamed.close()
    whole = OutputItems()
    finished = SimpleNamespace(completion=SimpleNamespace(text="".join(chunks)), finish_reason="stop")
    for piece in whole_pieces(output, finished)[0]:
        whole.feed(piece)
    whole.close()
    shape = [(item["type"], item["content"][0]["text"]) for item in streamed.items]
    assert shape == [("reasoning", "weigh it"), ("message", "The answer")]
    assert shape == [(item["type"], item["content"][0]["text"]) for item in whole.items]
