"""Suffix decoding's proposer: continuation counts over the request's own tokens and the outputs of recently finished
requests, indexed by every context of 1..max_depth tokens. A draft grows one token at a time with the most frequent
continuation of the longest context that has been seen; it stops when the product of the chosen tokens' frequencies
(the match confidence) falls below min_token_prob, so a request speculates long where its text repeats reliably and
short or not at all where it does not."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence


class ContinuationIndex:
    """context tuple (1..max_depth tokens) -> Counter of the token that followed it."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.counts: dict[tuple[int, ...], Counter] = {}
        self.num_indexed = 0  # of the sequence this index follows (per-request indexes grow as the request does)

    def extend(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count the continuations of tokens[num_indexed:] (sign -1 uncounts a sequence that leaves the index)."""
        tokens = list(tokens)
        for i in range(max(self.num_indexed, 1), len(tokens)):
            for n in range(1, min(self.max_depth, i) + 1):
                key = tuple(tokens[i - n : i])
                counter = self.counts.setdefault(key, Counter())
                counter[tokens[i]] += sign
                if sign < 0:
                    if counter[tokens[i]] <= 0:
                        del counter[tokens[i]]
                    if not counter:
                        del self.counts[key]
        self.num_indexed = len(tokens)

    def get(self, key: tuple[int, ...]) -> Counter | None:
        return self.counts.get(key)


class SuffixProposer:
    def __init__(self, max_depth: int, min_token_prob: float, max_cached_requests: int) -> None:
        self.max_depth, self.min_token_prob = max_depth, min_token_prob
        self.shared = ContinuationIndex(max_depth)  # outputs of recently finished requests
        self.recent: deque[list[int]] = deque()
        self.max_cached_requests = max_cached_requests
        self.own: dict[str, ContinuationIndex] = {}

    def propose_for(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        own = self.own.setdefault(request_id, ContinuationIndex(self.max_depth))
        own.extend(tokens)
        context, draft, confidence = list(tokens[-self.max_depth :]), [], 1.0
        while len(draft) < k:
            counts = self._longest_match(own, context)
            if counts is None:
                break
            token, count = counts.most_common(1)[0]
            confidence *= count / sum(counts.values())
            if confidence < self.min_token_prob:
                break
            draft.append(token)
            context = (context + [token])[-self.max_depth :]
        return draft

    def _longest_match(self, own: ContinuationIndex, context: list[int]) -> Counter | None:
        for n in range(min(self.max_depth, len(context)), 0, -1):
            key = tuple(context[-n:])
            mine, shared = own.get(key), self.shared.get(key)
            if mine or shared:
                return (mine or Counter()) + (shared or Counter())
        return None

    def finished(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request's own index goes; its output joins the shared one (the oldest leaves past the limit)."""
        self.own.pop(request_id, None)
        if not output_token_ids or self.max_cached_requests == 0:
            return
        output = list(output_token_ids)
        self._count(output, 1)
        self.recent.append(output)
        while len(self.recent) > self.max_cached_requests:
            self._count(self.recent.popleft(), -1)

    def _count(self, tokens: list[int], sign: int) -> None:
        self.shared.num_indexed = 0
        self.shared.extend(tokens, sign)
