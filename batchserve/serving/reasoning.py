"""`--reasoning-parser` for models that think in `<think>...</think>` before they answer: the thinking becomes
`reasoning_content`, the rest `content`, in a whole message or as stream deltas that assemble to the same.

qwen3: thinking only when the output opens with <think> (enable_thinking=false gives none); deepseek_r1: the
template opens <think> in the prompt, so the output is thinking until </think> (all of it, if that never comes)."""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinks_first: bool  # the output is reasoning from its first token, <think> or not (deepseek_r1)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output."""
        body = text.lstrip()
        opened = body.startswith(START)
        if not opened and not self.thinks_first:
            return None, text
        body = body.removeprefix(START)
        reasoning, ended, content = body.partition(END)
        if not ended:
            return (reasoning, None) if self.thinks_first or opened else (None, text)
        return reasoning, content.lstrip("\n") or None


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", thinks_first=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", thinks_first=True),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """Splits a streamed output the way ReasoningParser.split splits it whole: pieces are sent once their side of
    </think> is certain (a tail that may begin a marker is held back)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = self.sent_content = 0  # characters of the final split already sent

    def feed(self, delta_text: str, finished: bool) -> tuple[str, str]:
        self.text += delta_text
        if finished:
            reasoning, content = self.parser.split(self.text)
            return self._take(reasoning or "", content or "")
        body = self.text.lstrip()
        if not body or START.startswith(body) and not self.parser.thinks_first:
            return "", ""  # may still open with <think>
        if not body.startswith(START) and not self.parser.thinks_first:
            return self._take("", self.text)  # no thinking: all content
        body = body.removeprefix(START)
        reasoning, ended, content = body.partition(END)
        if not ended:
            return self._take(_safe(reasoning), "")
        content = content.lstrip("\n")
        return self._take(reasoning, content if content else "")

    def _take(self, reasoning: str, content: str) -> tuple[str, str]:
        r, c = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning, self.sent_content = (
            max(self.sent_reasoning, len(reasoning)),
            max(self.sent_content, len(content)),
        )
        return r, c


def _safe(text: str) -> str:
    """`text` without a tail that may be the start of </think>."""
    for keep in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-keep:]):
            return text[:-keep]
    return text
