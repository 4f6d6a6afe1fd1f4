"""Tool calls out of a model's text, per model family: Hermes `<tool_call>{json}</tool_call>` (Qwen2.5/Qwen3 and
ChatML models), Llama 3 JSON (`{"name": ..., "parameters": ...}`, `;`-separated, after an optional <|python_tag|>)
and Mistral `[TOOL_CALLS][{...}]`. A parser splits a finished text into (content, tool calls); streaming, it lets
content through until a tool call may be starting and holds the rest, so the calls a stream assembles are the ones
the same text gives at once (serving/tools.py)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(obj["name"], text, new_call_id())


class ToolParser:
    name = ""
    start_marker = ""  # text that opens the tool-call part of an output (content stops there)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of `text` is surely content (a stream may send it): up to the marker, or up to a tail that may
        be the marker's start."""
        at = text.find(self.start_marker)
        if at >= 0:
            return at
        for keep in range(min(len(self.start_marker) - 1, len(text)), 0, -1):
            if self.start_marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start_marker not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: the text stays content, as vLLM answers
            calls.append(call)
        content = text[: text.find(self.start_marker)].strip()
        return content or None, calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_marker = "{"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_json_objects(body):
            call = _call(part, "parameters")
            if call is None:
                return text, []
            calls.append(call)
        return (None, calls) if calls else (text, [])

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", "<|python_tag|>"[: len(stripped)], "<|python_tag|>")):
            return 0  # a call comes first or not at all: hold until it is clear
        return len(text)


class MistralToolParser(ToolParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start_marker)
        if at < 0:
            return text, []
        try:
            parsed = json.loads(text[at + len(self.start_marker) :].strip())
        except ValueError:
            return text, []
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [_call(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:at].strip() or None, calls  # type: ignore[return-value]


def _split_json_objects(body: str) -> list[object]:
    """`{...}; {...}` (or one object) -> the objects; [] when it is not that."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except ValueError:
            return []
        out.append(obj)
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return out


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def parser_for(name: str | None, chat_template: str | None) -> ToolParser:
    """--tool-call-parser when given, else the family the chat template writes calls in (Hermes by default)."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
        return PARSERS[name]()
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MistralToolParser()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonToolParser()
    return HermesToolParser()
