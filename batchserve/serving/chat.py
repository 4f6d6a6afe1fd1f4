"""Chat messages -> prompt token ids through the model's chat template; shared by every front end and LLM.chat."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

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


def _message(message: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError("each message must be an object with 'role' and 'content'", "messages")
    role, content = message.get("role"), message.get("content")
    if "content" not in message:
        raise InvalidRequestError("messages: each message needs 'content'", "messages")
    if role not in ROLES:
        raise InvalidRequestError(f"messages: role must be one of {ROLES}, got {role!r}", "messages")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidRequestError(f"messages: content must be a string, got {type(content).__name__}", "messages")
    # "developer" is OpenAI's newer name for the system role; templates know only "system"
    return {"role": "system" if role == "developer" else role, "content": content}
