"""Tool calling, protocol-neutral: the request's tools and tool_choice checked (400s naming the field), the
conversation with assistant tool_calls and tool messages rendered through a tool-capable chat template, `required`
and a named function enforced by a grammar (a JSON constraint, as vLLM does), and the output split into content and
tool calls, at once or as a stream whose assembled calls equal the ones given at once."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from batchserve.sampling_params import InvalidRequestError, StructuredOutputsParams
from batchserve.serving.structured import json_schema_constraint
from batchserve.serving.tool_parsers import ToolCall, ToolParser, new_call_id

SHIPPED_TEMPLATES = ("chatml_tools",)  # batchserve/serving/templates/<name>.jinja


def shipped_template(name: str) -> str:
    return resources.files("batchserve.serving").joinpath("templates", f"{name}.jinja").read_text()


def chat_template_for_tools(model_template: str | None) -> str | None:
    """The model's template when it renders tools; else the shipped ChatML one (for ChatML models such as the
    default SmolLM2, whose template has none); None: the model's own, for non-ChatML models."""
    template = model_template or ""
    if "tools" in template:
        return None
    return shipped_template("chatml_tools") if "<|im_start|>" in template else None


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """required: a JSON array of {name, parameters} calls; named: that function's arguments object."""
        if self.choice == "named":
            return json_schema_constraint(_parameters(self.functions[self.named]), "tool_choice")
        if self.choice != "required":
            return None
        calls = [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": _parameters(f)},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, f in self.functions.items()
        ]  # fmt: skip
        schema = {
            "type": "array",
            "items": {"anyOf": calls},
            "minItems": 1,
            **({} if self.parallel else {"maxItems": 1}),
        }
        return json_schema_constraint(schema, "tool_choice")


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    return dict(function.get("parameters") or {"type": "object", "properties": {}})


def tool_request(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest | None:
    """None when the request has no tools (and tool_choice asks for none)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):  # "auto" without tools is "none"
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    names = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(function, Mapping)
        ):
            raise InvalidRequestError("tools must be objects of type 'function' with a 'function' object", "tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError("each tool's function needs a name", "tools")
        json_schema_constraint(_parameters(function), "tools")  # a bad parameters schema is a 400 now
        names.add(function["name"])
    choice, named = _choice(tool_choice, names)
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolRequest([{"type": "function", "function": dict(t["function"])} for t in tools], choice, named, parallel)


def _choice(tool_choice: Any, names: set[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("function"), Mapping):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names a function that is not in tools: {name!r}", "tool_choice")
        return "named", name
    raise InvalidRequestError("tool_choice must be none, auto, required or {'type': 'function', ...}", "tool_choice")


def conversation_with_tools(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template: assistant tool_calls with their arguments as objects (templates write them as
    JSON), tool messages with their tool_call_id."""
    out = []
    for message in messages:
        item = dict(message)
        if item.get("tool_calls"):
            item["tool_calls"] = [_call_for_template(c) for c in item["tool_calls"]]
        out.append(item)
    return out


def _call_for_template(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(
            "messages: each tool call must be {'function': {'name': ..., 'arguments': ...}}", "messages"
        )
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            raise InvalidRequestError("messages: a tool call's arguments must be JSON", "messages") from None
    return {"id": call.get("id"), "type": "function", "function": function}


@dataclass
class ToolOutput:
    """One choice's output split into content and tool calls; for a stream, what may be sent so far."""

    request: ToolRequest
    parser: ToolParser
    text: str = ""
    sent_content: int = 0  # characters of text already sent as content
    calls: list[ToolCall] = field(default_factory=list)

    def final(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.request.choice == "named":
            return None, [ToolCall(self.request.named or "", text, new_call_id())]
        if self.request.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut short by max_tokens: no call, the text as it is
            calls = [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False), new_call_id()) for i in items]
            return None, calls
        return self.parser.extract(text)

    def content_delta(self, delta_text: str) -> str:
        """Streaming: the part of the text so far that is surely content and not yet sent."""
        self.text += delta_text
        if self.request.choice in ("named", "required"):
            return ""
        end = self.parser.content_end(self.text)
        piece = self.text[self.sent_content : end] if end > self.sent_content else ""
        self.sent_content = max(self.sent_content, end)
        return piece

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Streaming, at the end: the held-back content (when no call came) and the calls."""
        content, calls = self.final(self.text)
        if calls:
            return "", calls
        return self.text[self.sent_content :], []


def tool_call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """As OpenAI streams them: a call's first delta has its index, id, type and name with empty arguments, the next
    its arguments."""
    deltas = []
    for i, call in enumerate(calls):
        deltas.append({"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}})
        deltas.append({"index": i, "function": {"arguments": call.arguments}})
    return deltas


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: ToolRequest | None, chat_template: str | None,
    template_kwargs: Mapping[str, Any] | None, add_generation_prompt: bool,
) -> list[int]:  # fmt: skip
    """Prompt ids of a conversation that needs more than serving/chat.py renders: tools, tool calls and tool
    messages, a template in place of the model's, or extra template variables (chat_template_kwargs)."""
    conversation = conversation_with_tools(messages)
    has_tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in conversation)
    template = chat_template
    if template is None and (tools is not None or has_tool_turns):
        template = chat_template_for_tools(tokenizer.chat_template)
    rendered_tools = tools.tools if tools is not None and tools.choice != "none" else None
    kwargs = dict(template_kwargs or {})
    for reserved in ("conversation", "tools", "chat_template", "tokenize", "add_generation_prompt", "return_dict"):
        if reserved in kwargs:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved!r}", "chat_template_kwargs")
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=rendered_tools, chat_template=template,
                                            add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=False, **kwargs)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a template that cannot render this conversation is the caller's input
        raise InvalidRequestError(f"messages: cannot apply the chat template: {exc}", "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def named_tools(
    tools: Sequence[Any], kind: str, default: str | None, label: str, noun: str
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Each (path, tool) of a foreign API's tools list, a 400 naming the field for one that is not of type `kind`
    (`default` where it gives none) or has no name; the Responses and Messages front ends check their own fields."""
    for index, tool in enumerate(tools):
        path = f"tools[{index}]"
        given = tool.get("type", default) if isinstance(tool, Mapping) else None
        if given != kind:
            shown = tool.get("type") if isinstance(tool, Mapping) else None
            raise InvalidRequestError(f"{path}.type: only {label} tools are supported, got {shown!r}", f"{path}.type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequestError(f"{path}.name: {noun} needs a name", f"{path}.name")
        yield path, tool
