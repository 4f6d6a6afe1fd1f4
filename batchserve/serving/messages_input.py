"""Anthropic's Messages API input, translated onto the chat machinery: `system` and the messages' content blocks
(text, tool_use, tool_result; thinking blocks are left out, as chat history leaves reasoning out) become chat
messages; tools ({name, description, input_schema}) and tool_choice (auto, any, tool, none) become the chat form
serving/tools.py checks. Every malformed block is an InvalidRequestError naming its path
(`messages[1].content[0].type`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from batchserve.sampling_params import InvalidRequestError, StructuredOutputsParams
from batchserve.serving.structured import json_schema_constraint
from batchserve.serving.tools import named_tools

SKIPPED_BLOCK_TYPES = {"thinking", "redacted_thinking"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_messages(system: str | Sequence[Any] | None, messages: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    if system:
        out.append({"role": "system", "content": _system_text(system)})
    for index, message in enumerate(messages):
        out += _message(message, f"messages[{index}]")
    return out


def _system_text(system: str | Sequence[Any]) -> str:
    if isinstance(system, str):
        return system
    return "".join(_text_block(block, f"system[{i}]") for i, block in enumerate(system))


def _text_block(block: Any, path: str) -> str:
    kind = block.get("type") if isinstance(block, Mapping) else None
    if kind != "text":
        raise InvalidRequestError(f"{path}.type: must be a text block, got {kind!r}", f"{path}.type")
    if not isinstance(block.get("text"), str):
        raise InvalidRequestError(f"{path}.text: must be a string", f"{path}.text")
    return block["text"]


def _message(message: Any, path: str) -> list[dict[str, Any]]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"{path}: each message must be an object with role and content", path)
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise InvalidRequestError(f"{path}.role: must be user or assistant, got {role!r}", f"{path}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{path}.content: must be a text or a list of content blocks", f"{path}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        where = f"{path}.content[{index}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind not in SKIPPED_BLOCK_TYPES:
            allowed = "text, tool_use or thinking" if role == "assistant" else "text or tool_result"
            raise InvalidRequestError(f"{where}.type: a {role} block may be {allowed}, got {kind!r}", f"{where}.type")
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tool_use(block: Mapping[str, Any], path: str) -> dict[str, Any]:
    for name in ("id", "name"):
        if not isinstance(block.get(name), str) or not block[name]:
            raise InvalidRequestError(f"{path}.{name}: a tool_use block needs a string {name}", f"{path}.{name}")
    if not isinstance(block.get("input"), Mapping):
        raise InvalidRequestError(f"{path}.input: a tool_use block's input must be an object", f"{path}.input")
    arguments = json.dumps(block["input"], ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _tool_result(block: Mapping[str, Any], path: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise InvalidRequestError(f"{path}.tool_use_id: a tool_result block needs one", f"{path}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(b, f"{path}.content[{i}]") for i, b in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequestError(f"{path}.content: must be a text or a list of text blocks", f"{path}.content")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def chat_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools ({name, description, input_schema}) in the chat form."""
    if tools is None:
        return None
    out = []
    for path, tool in named_tools(tools, "custom", "custom", "client (custom)", "a tool"):
        if not isinstance(tool.get("input_schema"), Mapping):
            raise InvalidRequestError(
                f"{path}.input_schema: a tool needs an input_schema object", f"{path}.input_schema"
            )
        function = {"name": tool["name"], "parameters": dict(tool["input_schema"])}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Mapping[str, Any] | None) -> tuple[Any, bool | None]:
    """(the chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind], parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise InvalidRequestError(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


def output_constraint(config: Mapping[str, Any] | None) -> StructuredOutputsParams | None:
    """`output_config.format` ({"type": "json_schema", "schema"}) as the grammar engine's JSON constraint; `effort`
    is refused, as no model this server runs reads it."""
    if not config:
        return None
    for name in config:
        if name != "format" and config[name] is not None:
            raise InvalidRequestError(f"output_config.{name}: not supported by this server", f"output_config.{name}")
    spec = config.get("format")
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or spec.get("type") != "json_schema":
        raise InvalidRequestError("output_config.format.type: must be json_schema", "output_config.format.type")
    if "schema" not in spec:
        raise InvalidRequestError("output_config.format.schema: a json_schema format needs a schema",
                                  "output_config.format.schema")  # fmt: skip
    return json_schema_constraint(spec["schema"], "output_config.format.schema")
