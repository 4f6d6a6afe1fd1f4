"""Long-prompt isolation: how much prefill one step may carry, so that the decodes sharing the step keep their pace.

A prompt with more than `long_prefill_token_threshold` tokens left to compute is long. Each step gives a long prompt
at most that many tokens, lets at most `max_long_partial_prefills` long prompts and `max_num_partial_prefills` prompts
of any length prefill, and a waiting request that the caps hold back does not block the short ones behind it. The
decodes of the step therefore never wait more than threshold x max_long_partial_prefills prompt tokens of long prefill,
whatever the prompts' lengths (vLLM's knobs of the same names).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchserve.config import SchedulerConfig
from batchserve.request import Request


def remaining_tokens(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


@dataclass
class PrefillLimits:
    """One step's count of the prefills it has let in, against the configured caps (None / 0: no cap)."""

    threshold: int = 0
    max_partial: int | None = None
    max_long: int | None = None
    chunking: bool = True  # without chunked prefill a long prompt cannot be split: only the counts apply
    num_partial: int = 0
    num_long: int = 0

    @classmethod
    def of(cls, config: SchedulerConfig) -> PrefillLimits:
        return cls(config.long_prefill_token_threshold, config.max_num_partial_prefills,
                   config.max_long_partial_prefills, config.enable_chunked_prefill)  # fmt: skip

    @property
    def active(self) -> bool:
        return bool(self.threshold or self.max_partial or self.max_long)

    def is_long(self, request: Request) -> bool:
        return 0 < self.threshold < remaining_tokens(request)

    def admits(self, request: Request) -> bool:
        """May this request's prefill (if it has one) join the step?"""
        if remaining_tokens(request) <= 1:
            return True  # a decode
        if self.max_partial is not None and self.num_partial >= self.max_partial:
            return False
        return not (self.is_long(request) and self.max_long is not None and self.num_long >= self.max_long)

    def cap(self, request: Request, budget: int) -> int:
        """The token budget this request's chunk may use."""
        if self.chunking and self.is_long(request):
            return min(budget, self.threshold)
        return budget

    def count(self, request: Request) -> None:
        """The request's prefill chunk is in the step."""
        if remaining_tokens(request) > 1:
            self.num_partial += 1
            self.num_long += self.is_long(request)
