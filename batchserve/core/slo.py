"""Service-level targets in the scheduler: each request's TTFT / TPOT targets and queue deadline, a prediction of when
a waiting request will get its first token, and the slack that orders preemption.

The prediction prices the prefill work ahead of a request (running prompts still prefilling, the waiting prompts
served before it, its own prompt) and the wait for a batch slot, in steps of the step-time model: seconds = fixed +
per_token x tokens, the same fit the speculative planner keeps (core/speculation_cost.py), fed each step by the engine
(LLMEngine) or the simulator (SimEngine) with the step's scheduled tokens and its model time. Until the fit has seen
enough steps there is no prediction, and no request is refused or demoted for one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from batchserve.config import SchedulerConfig, SloAdmission
from batchserve.core.prefill_limits import PrefillLimits, remaining_tokens
from batchserve.core.speculation_cost import StepCostModel
from batchserve.request import Request

NO_SLACK_TARGET = math.inf  # a request without targets: the first to give way


class SloUnattainableError(RuntimeError):
    """The request cannot meet its TTFT target or its deadline at the present load: refused before it takes blocks.
    Front ends answer it as an overload (503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[str, float | None]]:  # pickled whole (Ray sends it)
        return type(self), (str(self), self.retry_after_s)


class StepCost(Protocol):
    def coefficients(self) -> tuple[float, float] | None: ...  # (fixed seconds, seconds per token)

    def observe(self, tokens: int, seconds: float) -> None: ...


@dataclass
class FixedStepCost:
    """A step cost known in advance (a profile's fit, a test's numbers) instead of learnt online."""

    fixed_s: float
    per_token_s: float

    def coefficients(self) -> tuple[float, float]:
        return self.fixed_s, self.per_token_s

    def observe(self, tokens: int, seconds: float) -> None:
        pass


def resolve_targets(request: Request, config: SchedulerConfig) -> None:
    """The request's own targets, else the server's defaults, in seconds."""
    params = request.sampling_params
    ttft_ms = params.ttft_slo_ms if params.ttft_slo_ms is not None else config.ttft_slo_ms
    tpot_ms = params.tpot_slo_ms if params.tpot_slo_ms is not None else config.tpot_slo_ms
    request.ttft_slo_s = None if ttft_ms is None else ttft_ms / 1000.0
    request.tpot_slo_s = None if tpot_ms is None else tpot_ms / 1000.0


def ttft_deadline(request: Request) -> float:
    return math.inf if request.ttft_slo_s is None else request.arrival_time + request.ttft_slo_s


def slack_s(request: Request, now: float) -> float:
    """Seconds a running request can lose before it misses a target: before its first token, the time left to its
    TTFT target; after, the time its TPOT target allows for the tokens so far, less the time they took."""
    if request.first_token_time is None:
        if request.ttft_slo_s is None:
            return NO_SLACK_TARGET
        return request.arrival_time + request.ttft_slo_s - now
    if request.tpot_slo_s is None:
        return NO_SLACK_TARGET
    return request.first_token_time + request.tpot_slo_s * request.num_output_tokens - now


@dataclass
class SlotReserve:
    """The last `reserved` batch slots go only to requests that cannot wait for a regular one. With a sequence cap,
    slots, not tokens, are what a short request waits for: summaries that decode for hundreds of steps would otherwise
    fill the batch while questions with a 500 ms target queue behind them. A request whose TTFT slack outlasts the
    predicted wait for a regular slot (the running request closest to its end finishing) and its own prefill waits
    for one; a request without a target always can."""

    reserved: int
    max_batch_size: int
    max_num_tokens: int
    num_held_back: int = 0  # times a request was kept out of the reserved slots

    @property
    def active(self) -> bool:
        return self.reserved > 0

    def admits(self, request: Request, running: list[Request], now: float, limits: PrefillLimits,
               cost: StepCost) -> bool:  # fmt: skip
        """May the request take a slot now? (`limits`: the step's prefill caps, which chunk its prompt.)"""
        if self.max_batch_size - len(running) > self.reserved or request.first_scheduled_time is not None:
            return True  # a regular slot, or a preempted request resuming: holding it back wastes its work
        if request.ttft_slo_s is not None:  # without a target it can always wait
            coefficients = cost.coefficients()
            if coefficients is None:
                return True  # nothing to predict with yet
            if slack_s(request, now) < self._regular_wait_s(request, running, limits, *coefficients):
                return True
        self.num_held_back += 1
        return False

    def _regular_wait_s(self, request: Request, running: list[Request], limits: PrefillLimits, fixed_s: float,
                        per_token_s: float) -> float:  # fmt: skip
        """Seconds to its first token if it waits for a regular slot: the running request nearest its end finishes,
        then its own prompt, chunked as the prefill caps allow."""
        step_s = fixed_s + per_token_s * len(running)
        steps = min(r.sampling_params.max_tokens - r.num_output_tokens for r in running)
        own = remaining_tokens(request)
        steps += math.ceil(own / limits.cap(request, self.max_num_tokens))
        return steps * step_s + per_token_s * own


@dataclass
class LoadSnapshot:
    """What is ahead of a waiting request when the scheduler looks: filled once per look, then extended."""

    prefill_tokens_ahead: int  # prompt tokens that will be computed before its own
    long_tokens_ahead: int  # of long prompts (long_prefill_token_threshold): a short one overtakes them
    num_decodes: int  # running sequences past their prompt: each takes a token of every step
    decode_steps_left: list[int]  # running requests' remaining output tokens, sorted: when their slots free
    free_slots: int  # max_batch_size - running
    num_ahead: int = 0  # waiting requests before it that will take slots
    # their TTFT deadlines: with a slot reserve, one with a later deadline than its own lets it pass (SlotReserve)
    ahead_deadlines: list[float] = field(default_factory=list)


class SloPlanner:
    """Predicts a waiting request's first-token time and decides what happens to one that will miss."""

    def __init__(self, config: SchedulerConfig, cost: StepCost | None = None) -> None:
        self.config = config
        self.cost: StepCost = cost if cost is not None else StepCostModel()
        self.num_refused = 0
        self.num_demoted = 0
        self.num_deadline_dropped = 0

    @property
    def mode(self) -> SloAdmission:
        return self.config.slo_admission

    def check_admission(
        self, request: Request, running: Iterable[Request], waiting: Iterable[Request], now: float
    ) -> None:
        """Refuse (SloUnattainableError), before it takes a block, a request predicted to miss its TTFT target
        (slo_admission refuse) or its deadline; under deprioritize one that would miss its target is demoted."""
        if self.mode == SloAdmission.OFF and request.deadline is None:
            return
        if request.deadline is not None and request.deadline <= now:
            raise SloUnattainableError("the request's deadline has passed")
        load = self.snapshot(running)
        for ahead in waiting:
            if not ahead.slo_demoted:
                self.account(ahead, load)
        late = self.will_miss(request, load, now)
        if late is None:
            return
        if self.mode == SloAdmission.DEPRIORITIZE:
            request.slo_demoted = True
            self.num_demoted += 1
            return
        self.num_refused += 1
        raise SloUnattainableError(
            f"at the present load its first token is predicted {1000 * late:.0f} ms after its TTFT target or "
            f"deadline; retry later",
            retry_after_s=late,
        )

    def review_waiting(self, waiting, running: Iterable[Request], now: float) -> list[tuple[Request, str]]:
        """Each step, in queue order: the never-started requests whose deadline has passed, and under refuse those
        now predicted to miss their TTFT target, to be dropped, with why; under deprioritize those are demoted in
        `waiting` here."""
        drops = []
        load = self.snapshot(running)
        for request in list(waiting):
            if request.slo_demoted:
                continue
            if request.deadline is not None and request.first_scheduled_time is None and now > request.deadline:
                self.num_deadline_dropped += 1
                drops.append((request, "deadline"))
                continue
            late = None if self.mode == SloAdmission.OFF else self.will_miss(request, load, now)
            if late is None:
                self.account(request, load)
            elif self.mode == SloAdmission.REFUSE:
                self.num_refused += 1
                drops.append((request, "slo_unattainable"))
            else:
                self.num_demoted += 1
                waiting.demote(request)
        return drops

    def _is_long(self, request: Request) -> bool:
        return 0 < self.config.long_prefill_token_threshold < remaining_tokens(request)

    def snapshot(self, running: Iterable[Request]) -> LoadSnapshot:
        running = list(running)
        prefills = [r for r in running if remaining_tokens(r) > 1]
        short = sum(remaining_tokens(r) for r in prefills if not self._is_long(r))
        long = sum(remaining_tokens(r) for r in prefills if self._is_long(r))
        left = sorted(r.sampling_params.max_tokens - r.num_output_tokens for r in running)
        return LoadSnapshot(short, long, len(running) - len(prefills), left, self.config.max_batch_size - len(running))

    def predicted_wait_s(self, request: Request, load: LoadSnapshot) -> float | None:
        """Seconds from now to the request's first token, served after what `load` holds; None without a fit."""
        coefficients = self.cost.coefficients()
        if coefficients is None:
            return None
        fixed_s, per_token_s = coefficients
        own = remaining_tokens(request)
        if self._is_long(request):  # behind everything ahead of it, at most a threshold a step
            ahead, beside = load.prefill_tokens_ahead + load.long_tokens_ahead, 0
            own_per_step = self.config.long_prefill_token_threshold
        else:  # long prompts ahead only take their chunk of each step: it overtakes them
            ahead, beside, own_per_step = load.prefill_tokens_ahead, self._long_chunk(load), own
        per_step = max(1, self.config.max_num_tokens - load.num_decodes - beside)
        steps = max(math.ceil((ahead + own) / per_step), math.ceil(own / max(1, min(own_per_step, per_step))))
        step_s = fixed_s + per_token_s * (load.num_decodes + beside)
        prefill_s = steps * step_s + per_token_s * (ahead + own)
        return max(prefill_s, self._slot_wait_steps(load, self._ahead_for_slots(request, load)) * step_s
                   + per_token_s * own)  # fmt: skip

    def _long_chunk(self, load: LoadSnapshot) -> int:
        """Tokens of long prefill in each step while there is any."""
        if not load.long_tokens_ahead:
            return 0
        most = self.config.long_prefill_token_threshold * (self.config.max_long_partial_prefills or 1)
        return min(most, load.long_tokens_ahead)

    def _ahead_for_slots(self, request: Request, load: LoadSnapshot) -> int:
        """Waiting requests that take a batch slot before it: all those ahead, or with a slot reserve only those due
        first (a request with more slack waits for a regular slot and lets it have the reserved one)."""
        if not self.config.reserved_slots:
            return load.num_ahead
        own = ttft_deadline(request)
        return sum(1 for deadline in load.ahead_deadlines if deadline <= own)

    @staticmethod
    def _slot_wait_steps(load: LoadSnapshot, num_ahead: int) -> int:
        """Steps until a batch slot frees for it: the k-th earliest finish among the running, k being how many
        requests ahead of it (itself included) find no free slot."""
        short = num_ahead + 1 - load.free_slots
        if short <= 0 or not load.decode_steps_left:
            return 0
        return load.decode_steps_left[min(short, len(load.decode_steps_left)) - 1]

    def will_miss(self, request: Request, load: LoadSnapshot, now: float) -> float | None:
        """How late (seconds) the request's first token is predicted against its TTFT target or deadline, if late;
        None when on time, without a target, or without a prediction."""
        limits = []
        if request.ttft_slo_s is not None and self.mode != SloAdmission.OFF:
            limits.append(request.arrival_time + request.ttft_slo_s)
        if request.deadline is not None:
            limits.append(request.deadline)
        if not limits or request.first_token_time is not None:
            return None
        wait = self.predicted_wait_s(request, load)
        if wait is None:
            return None
        late = now + wait - min(limits)
        return late if late > 0 else None

    def account(self, request: Request, load: LoadSnapshot) -> None:
        """The request stays ahead of those after it: its prompt and its slot count in their predictions (a long
        prompt's only in part: short requests overtake it while it waits for a long-prefill slot)."""
        if self._is_long(request):
            load.long_tokens_ahead += remaining_tokens(request)
            return
        load.prefill_tokens_ahead += remaining_tokens(request)
        load.num_ahead += 1
        load.ahead_deadlines.append(ttft_deadline(request))
