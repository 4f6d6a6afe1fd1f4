"""A request's move to another replica when its replica is lost (Handover): the ingress keeps the tokens it has
streamed, and the request goes on elsewhere as its prompt plus those tokens, with what is left of its budget
(max_tokens, min_tokens), so the new replica prefills them and decodes the rest. Its outputs there are
renumbered as the original request's (counts, first-token time), so the stream's reader sees one stream; greedy,
that is the same tokens an undisturbed run gives.

A request that has streamed nothing is simply retried. One that has streamed tokens moves only where going on from
the text is exact: not under an output constraint (the grammar would restart at the moved prompt's end) nor with
presence/frequency penalties (they count output tokens, which would restart at 0); those end with the replica's
error (503 or an error event), as before migration existed. A stop string straddling the tokens sent before the
move and those after it is not seen.
"""

from __future__ import annotations

import dataclasses

from batchserve.engine.outputs import CompletionDelta, RequestMetrics
from batchserve.request import EngineRequest

MAX_MIGRATIONS = 4  # placements tried per lost replica before the request ends with the error


class Handover:
    """What an ingress remembers of a request so that another replica can take it over."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.sent: list[int] = []  # output tokens relayed to the reader so far
        self.offset = 0  # of which were sent before the current placement
        self.moved = False
        self.last_metrics: RequestMetrics | None = None  # of the last output relayed
        self.before: RequestMetrics | None = None  # the last ones before the request moved

    @property
    def moves(self) -> bool:
        """Whether the request may go on elsewhere from what it has sent (see the module's docstring)."""
        params = self.request.sampling_params
        exact = params.structured_outputs is None and not params.presence_penalty and not params.frequency_penalty
        return not self.sent or exact

    def relayed(self, out: CompletionDelta) -> CompletionDelta:
        """`out` of the current placement, as the original request's output."""
        if self.moved:
            out = dataclasses.replace(
                out,
                num_prompt_tokens=self.request.num_prompt_tokens,
                num_output_tokens=out.num_output_tokens + self.offset,
                metrics=self._merged(out.metrics),
                prompt_logprobs=None if self.offset else out.prompt_logprobs,
            )
        self.last_metrics = out.metrics
        self.sent += out.delta_token_ids
        return out

    def _merged(self, metrics: RequestMetrics) -> RequestMetrics:
        """The times of the request's start where it started; preemptions counted on every replica."""
        before = self.before
        if before is None:
            return metrics
        return dataclasses.replace(
            metrics,
            arrival_time=before.arrival_time,
            first_scheduled_time=before.first_scheduled_time or metrics.first_scheduled_time,
            first_token_time=before.first_token_time or metrics.first_token_time,
            num_cached_tokens=before.num_cached_tokens if before.first_scheduled_time else metrics.num_cached_tokens,
            num_preemptions=before.num_preemptions + metrics.num_preemptions,
        )

    def continuation(self) -> EngineRequest:
        """The request as another replica should run it now."""
        sent, params = len(self.sent), self.request.sampling_params
        self.offset, self.moved = sent, True
        if self.last_metrics is not None:
            self.before = self.last_metrics
        if not sent:
            return self.request
        rest = dataclasses.replace(
            params, max_tokens=params.max_tokens - sent, min_tokens=max(0, params.min_tokens - sent),
            prompt_logprobs=None,
        )  # fmt: skip
        return dataclasses.replace(
            self.request, prompt_token_ids=self.request.prompt_token_ids + self.sent, sampling_params=rest, prompt=None
        )
