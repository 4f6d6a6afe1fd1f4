"""Incremental detokenization and stop-string detection, one small object per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream


@dataclass
class IncrementalDetokenizer:
    """Turns one token at a time into text (Rust DecodeStream: no re-decoding of the whole sequence), cuts the
    text at the first stop string, and holds back a possible stop-string prefix from the stream."""

    tokenizer: object  # a transformers PreTrainedTokenizerFast
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""
    stopped_by: str | None = None
    _sent: int = 0  # characters already handed out as deltas

    def __post_init__(self) -> None:
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self._backend = self.tokenizer.backend_tokenizer
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

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
