"""Chat messages -> prompt token ids through the model's chat template; shared by every front end and LLM.chat."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from batchserve.engine.inputs import check_text
from batchserve.sampling_params import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a conversation ([{"role", "content"}, ...]); InvalidRequestError if it cannot be rendered."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    conversation = [_message(m) for m in messages]
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    except Exception as exc:  # noqa: BLE001 - a template that cannot render this conversation is the caller's input
        raise InvalidRequestError(f"messages: cannot apply the chat template: {exc}", "messages") from None
    if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding whatever return_dict says
        ids = ids["input_ids"]
    return list(ids)


def message_shape_error(role: Any, has_content: bool, content: Any, tool_calls: Any, tool_call_id: Any) -> str | None:
    """What is wrong with a message's shape by OpenAI's rules, or None: system, developer, user and tool messages
    carry content (not null); an assistant message carries content unless it makes tool calls; a tool message
    names the call it answers (tool_call_id). Every front end and LLM.chat refuse by this one rule."""
    if role not in ROLES:
        return f"role must be one of {ROLES}, got {role!r}"
    if (not has_content or content is None) and not (role == "assistant" and tool_calls):
        return f"a {role} message needs 'content'" + (" (or tool_calls)" if role == "assistant" else "")
    if role == "tool" and not (isinstance(tool_call_id, str) and tool_call_id):
        return "a tool message needs tool_call_id, the id of the call it answers"
    return None


def _message(message: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError("each message must be an object with 'role' and 'content'", "messages")
    role, content = message.get("role"), message.get("content")
    shape_error = message_shape_error(
        role, "content" in message, content, message.get("tool_calls"), message.get("tool_call_id")
    )
    if shape_error is not None:
        raise InvalidRequestError(f"messages: {shape_error}", "messages")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidRequestError(f"messages: content must be a string, got {type(content).__name__}", "messages")
    check_text(content, "messages")
    # "developer" is OpenAI's newer name for the system role; templates know only "system"
    return {"role": "system" if role == "developer" else role, "content": content}
