"""A chat choice's text as OpenAI lays it out: content, tool_calls (serving/tools.py) and reasoning_content
(serving/reasoning.py), in a whole message or as stream deltas whose assembly equals the whole message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchserve.serving.reasoning import ReasoningParser, ReasoningStream
from batchserve.serving.tool_parsers import ToolParser
from batchserve.serving.tools import ToolOutput, ToolRequest, tool_call_deltas


@dataclass
class ChatOutputFormat:
    """What a request's choices are parsed with (None: plain content)."""

    tools: ToolRequest | None = None
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message, the finish_reason: tool_calls when calls ended the turn)."""
        message: dict[str, Any] = {"role": "assistant"}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
            message["reasoning_content"] = reasoning
        if self.tools is None or not self.tools.parses_output or self.tool_parser is None:
            return {**message, "content": text}, finish_reason
        content, calls = ToolOutput(self.tools, self.tool_parser).final(text)
        if not calls:
            return {**message, "content": content}, finish_reason
        message |= {"content": content, "tool_calls": [c.as_openai() for c in calls]}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def stream(self) -> ChoiceStream:
        tools = None
        if self.tools is not None and self.tools.parses_output and self.tool_parser is not None:
            tools = ToolOutput(self.tools, self.tool_parser)
        return ChoiceStream(tools, ReasoningStream(self.reasoning) if self.reasoning is not None else None)


@dataclass
class ChoiceStream:
    tools: ToolOutput | None
    reasoning: ReasoningStream | None
    called: bool = False  # tool calls went out: the finish_reason is tool_calls
    _pending: list[dict[str, Any]] = field(default_factory=list)

    def delta(self, delta_text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas this piece of text makes (each a chunk's `delta`), the last ones at the end."""
        deltas: list[dict[str, Any]] = []
        content = delta_text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta_text, finished)
            if reasoning:
                deltas.append({"reasoning_content": reasoning})
        if self.tools is not None:
            text = self.tools.content_delta(content)
            if finished:
                rest, calls = self.tools.finish()
                text += rest
                if calls:
                    self.called = True
                    deltas += [{"content": text}] if text else []
                    return deltas + [{"tool_calls": [d]} for d in tool_call_deltas(calls)]
            content = text
        if content:
            deltas.append({"content": content})
        return deltas
