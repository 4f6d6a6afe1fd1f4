"""OpenAI's Responses API input, translated onto the chat machinery: `input` (a text, or a list of items: messages,
function calls and their outputs, reasoning) becomes chat messages; its flat function tools, tool_choice and
`text.format` become the chat form that serving/tools.py and serving/structured.py already check. Every malformed
item is an InvalidRequestError naming its path (`input[2].content[0].type`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from batchserve.sampling_params import InvalidRequestError, StructuredOutputsParams
from batchserve.serving.structured import from_response_format
from batchserve.serving.tools import named_tools

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PART_TYPES = {"input_text", "output_text", "text"}  # what a message's content list may hold
SKIPPED_ITEM_TYPES = {"reasoning"}  # a client sends these back; the template never sees past reasoning


def input_messages(value: str | Sequence[Any]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`; consecutive function_call items join one assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidRequestError("input: give a text or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        path = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{path}: each item must be an object", path)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, path))
        elif kind == "function_call":
            _add_call(messages, _function_call(item, path))
        elif kind == "function_call_output":
            messages.append(_call_output(item, path))
        elif kind not in SKIPPED_ITEM_TYPES:
            raise InvalidRequestError(
                f"{path}.type: {kind!r} is not supported; items may be message, function_call, "
                "function_call_output or reasoning",
                f"{path}.type",
            )
    if not messages:
        raise InvalidRequestError("input: no message, function call or function call output in it", "input")
    return messages


def _message(item: Mapping[str, Any], path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidRequestError(
            f"{path}.role: must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", f"{path}.role"
        )
    return {"role": "system" if role == "developer" else role, "content": _text(item.get("content"), f"{path}.content")}


def _text(content: Any, path: str) -> str:
    """A message's content: a text, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{path}: must be a text or a list of content parts", path)
    pieces = []
    for index, part in enumerate(content):
        where = f"{path}[{index}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in TEXT_PART_TYPES:
            raise InvalidRequestError(
                f"{where}.type: only text parts (input_text, output_text) are supported, got {kind!r}", f"{where}.type"
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}.text: must be a string", f"{where}.text")
        pieces.append(part["text"])
    return "".join(pieces)


def _function_call(item: Mapping[str, Any], path: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
            raise InvalidRequestError(f"{path}.{name}: a function_call item needs a string {name}", f"{path}.{name}")
    try:
        json.loads(item["arguments"])
    except ValueError:
        raise InvalidRequestError(f"{path}.arguments: must be JSON text", f"{path}.arguments") from None
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    elif last is not None and last["role"] == "assistant" and last["content"]:
        last["tool_calls"] = [call]  # text then calls: one assistant turn, as the chat API writes it
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: Mapping[str, Any], path: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise InvalidRequestError(f"{path}.call_id: a function_call_output item needs a call_id", f"{path}.call_id")
    output = item.get("output")
    text = output if isinstance(output, str) else _text(output, f"{path}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": text}


def chat_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({type, name, description, parameters, strict}) in the chat form."""
    if tools is None:
        return None
    out = []
    for _, tool in named_tools(tools, "function", None, "function", "a function tool"):
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses' {"type": "function", "name"} in the chat form; the strings are the same."""
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def text_format_constraint(text: Mapping[str, Any] | None) -> StructuredOutputsParams | None:
    """`text.format` ({type: text | json_object | json_schema, name, schema, strict}) through the chat API's
    response_format checks."""
    if text is None or text.get("format") is None:
        return None
    spec = text["format"]
    if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
        raise InvalidRequestError("text.format: needs a string type", "text.format")
    if spec["type"] == "json_schema":
        if "schema" not in spec:
            raise InvalidRequestError("text.format.schema: a json_schema format needs a schema", "text.format.schema")
        response_format = {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": spec["schema"]}}
    else:
        response_format = {"type": spec["type"]}
    try:
        return from_response_format(response_format)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc).replace("response_format", "text.format"), "text.format") from None
