"""What the Responses and Messages front ends share with chat completions: a conversation (chat messages, as the
chat route builds them) rendered to prompt ids the same way, and one assistant turn's output read by the chat
route's parsers (tool calls, reasoning) as a sequence of neutral pieces that each API lays out in its own shape."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from batchserve.entrypoints.openai.chat import with_tool_constraint
from batchserve.entrypoints.openai.chat_output import ChatOutputFormat, ChoiceStream
from batchserve.entrypoints.openai.front import OpenAIFrontEnd
from batchserve.sampling_params import SamplingParams, StructuredOutputsParams
from batchserve.serving.reasoning import reasoning_parser
from batchserve.serving.results import GenerationResult
from batchserve.serving.tool_parsers import parser_for
from batchserve.serving.tools import ToolRequest, render_chat


async def conversation_prompt(
    front: OpenAIFrontEnd, messages: Sequence[Mapping[str, Any]], tools: ToolRequest | None
) -> list[int]:
    """Prompt ids of chat messages, rendered as /v1/chat/completions renders the same conversation: the plain
    template path unless tools, tool turns or another template are involved."""
    service = front.service
    tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if tools is None and not tool_turns and front.chat_template is None:
        return await service.chat_prompt(messages, True)
    service.check_text_length(sum(len(m.get("content") or "") for m in messages))
    return await asyncio.to_thread(render_chat, service.tokenizer, messages, tools, front.chat_template, None, True)


def turn_params(
    front: OpenAIFrontEnd, prompt_len: int, max_tokens: int | None, tools: ToolRequest | None,
    constraint: StructuredOutputsParams | None = None, **sampling: Any,
) -> SamplingParams:  # fmt: skip
    """Sampling parameters of one turn: the unset fields are the engine's defaults, max_tokens the rest of the
    context when not given; a tool_choice that forces calls brings its grammar (which no other constraint joins)."""
    options = {name: value for name, value in sampling.items() if value is not None}
    if max_tokens is None:
        max_tokens = front.service.limits.default_max_tokens(prompt_len)
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=constraint, **options)
    return with_tool_constraint(params, tools)


def output_format(front: OpenAIFrontEnd, tools: ToolRequest | None) -> ChatOutputFormat:
    template = front.chat_template or front.service.tokenizer.chat_template
    parser = parser_for(front.tool_call_parser, template) if tools is not None else None
    return ChatOutputFormat(tools, parser, reasoning_parser(front.reasoning_parser))


@dataclass(frozen=True)
class Piece:
    """A piece of an assistant turn, in the order the turn says it: reasoning or text (a fragment of it), the
    start of a tool call (its id and name), or a fragment of a call's arguments."""

    kind: Literal["reasoning", "text", "call", "arguments"]
    text: str = ""  # reasoning, text or arguments
    call_id: str = ""
    name: str = ""


class TurnStream:
    """One choice's results -> pieces, through the chat route's ChoiceStream: the pieces of a stream assemble to
    the pieces of the whole text (`whole_pieces`)."""

    def __init__(self, output: ChatOutputFormat) -> None:
        self.choice: ChoiceStream = output.stream()

    def feed(self, result: GenerationResult) -> list[Piece]:
        return list(_pieces(self.choice.delta(result.delta.delta_text, result.finished)))


def whole_pieces(output: ChatOutputFormat, result: GenerationResult) -> tuple[list[Piece], str | None]:
    """A finished choice's pieces and finish reason (tool_calls when calls ended the turn)."""
    message, finish_reason = output.message(result.completion.text, result.finish_reason)
    deltas = [{"reasoning_content": message.get("reasoning_content")}, {"content": message.get("content")}]
    for call in message.get("tool_calls") or []:
        deltas.append({"tool_calls": [{"id": call["id"], "function": {"name": call["function"]["name"]}}]})
        deltas.append({"tool_calls": [{"function": {"arguments": call["function"]["arguments"]}}]})
    return list(_pieces(deltas)), finish_reason


def _pieces(deltas: list[dict[str, Any]]) -> Iterator[Piece]:
    for delta in deltas:
        if delta.get("reasoning_content"):
            yield Piece("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            yield Piece("text", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                yield Piece("call", call_id=call["id"], name=function.get("name") or "")
            if function.get("arguments"):
                yield Piece("arguments", function["arguments"])


@dataclass
class Turn:
    """A turn's pieces assembled: in order, blocks of reasoning or text, and tool calls (id, name, arguments)."""

    blocks: list[dict[str, str]] = dataclasses.field(default_factory=list)  # {"kind", "text"} or {"kind": "call", ...}

    def add(self, piece: Piece) -> None:
        last = self.blocks[-1] if self.blocks else None
        if piece.kind == "call":
            self.blocks.append({"kind": "call", "call_id": piece.call_id, "name": piece.name, "arguments": ""})
        elif piece.kind == "arguments":
            assert last is not None and last["kind"] == "call", "arguments follow their call"
            last["arguments"] += piece.text
        elif last is not None and last["kind"] == piece.kind:
            last["text"] += piece.text
        else:
            self.blocks.append({"kind": piece.kind, "text": piece.text})

    def chat_message(self) -> dict[str, Any]:
        """The turn as an assistant chat message (reasoning left out, as chat history leaves it)."""
        text = "".join(b["text"] for b in self.blocks if b["kind"] == "text")
        calls = [
            {"id": b["call_id"], "type": "function", "function": {"name": b["name"], "arguments": b["arguments"]}}
            for b in self.blocks
            if b["kind"] == "call"
        ]
        return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def arguments_object(arguments: str) -> Any:
    """A call's arguments as a JSON value (the text itself when a cut-short call left it malformed)."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments
