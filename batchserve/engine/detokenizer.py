"""Incremental detokenization and stop-string detection, one small object per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

# Prompt tokens the stream starts from, as context only: enough for the decoder to see that the first generated
# token does not begin the text (a SentencePiece or WordPiece decoder drops the leading space of the first token it
# decodes), few enough that starting a request costs nothing measurable.
CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    """Turns one token at a time into text (Rust DecodeStream: no re-decoding of the whole sequence), cuts the
    text at the first stop string, and holds back a possible stop-string prefix from the stream. The stream starts
    after the prompt's last tokens (`context`, decoded and not output), so that the first generated token reads as
    it does after the prompt (" world", not "world"), as vLLM's and TGI's outputs do."""

    tokenizer: object  # a transformers PreTrainedTokenizerFast
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    context: Sequence[int] = ()  # the prompt's token ids
    text: str = ""
    stopped_by: str | None = None
    _sent: int = 0  # characters already handed out as deltas

    def __post_init__(self) -> None:
        self._backend = self.tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=self._context_ids(), skip_special_tokens=self.skip_special_tokens)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def _context_ids(self) -> list[int]:
        """The prompt's last CONTEXT_TOKENS ids, or none where they end inside a character (their text ends in the
        replacement character): the stream then could not tell the prompt's bytes from the first token's."""
        tail = list(self.context[-CONTEXT_TOKENS:])
        if tail and self._backend.decode(tail, skip_special_tokens=self.skip_special_tokens).endswith("\ufffd"):
            return []
        return tail

    def add_token(self, token_id: int) -> None:
        piece = self._stream.step(self._backend, token_id)
        if not piece or self.stopped_by is not None:
            return
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> None:
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        index, stop = min(hits)
        self.stopped_by = stop
        self.text = self.text[: index + len(stop) if self.include_stop_str_in_output else index]

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; while running, a tail that could start a stop string waits."""
        end = len(self.text) if finished or self.stopped_by else max(self._sent, len(self.text) - self._holdback)
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
