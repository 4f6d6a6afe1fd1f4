"""Iteration-level scheduler.

There is no prefill or decode phase here. Each request has num_tokens (prompt + generated) and num_computed_tokens
(K/V in the cache); every step hands out tokens within max_num_tokens and max_batch_size so that computed counts
catch up. Chunked prefill, prefix hits, recompute after preemption and mixed batches all follow from that rule.

Policies (scheduler_policy):
- max_utilization: admit while budgets and free blocks allow; when a running request needs a block and none is
  free, preempt the lowest-ranked running request (recompute or swap).
- guaranteed_no_evict: admit only when the worst case (prompt + max_tokens) of the newcomer fits on top of the
  worst case of everything running; nothing is ever preempted.
- static: a batch is formed from the waiting queue when the last one has finished; no one joins mid-batch. With
  static_padding (the default) a finished member stays as padding, computed and holding its blocks, until the last
  one is done (classic static batching's padded tensor); its result is returned when it finishes.

Beside them, for latency targets (docs/slo.md): long-prompt isolation (core/prefill_limits.py: a long prompt is
chunked, few prefill at once, a held-back one blocks no short one), SLO admission (core/slo.py: a request predicted
to miss its TTFT target or deadline is refused or demoted before it takes blocks; preemption by slack; the last
slo_reserved_slots batch slots only for requests that cannot wait for another), a thrash guard
(max_preemptions_per_request: a request preempted that often is pinned, ranked first, let in when it fits)."""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Iterable

from batchserve.config import (
    PreemptionMode,
    SchedulerConfig,
    SchedulerPolicy,
    SchedulingOrder,
    SloAdmission,
    SpeculativeConfig,
)
from batchserve.core.capacity import CapacityPolicy
from batchserve.core.kv_cache_manager import KVCacheManager, PrefixHit
from batchserve.core.long_context import draft_room, mark_if_long, outgrew_short_context, start_over
from batchserve.core.lora_schedule import AdapterGate
from batchserve.core.outputs import ModelOutput, RequestOutput, SchedulerOutput, SchedulerStats
from batchserve.core.prefill_limits import PrefillLimits
from batchserve.core.request_queue import DemotingQueue, make_request_queue
from batchserve.core.scheduler_stats import scheduler_stats
from batchserve.core.slo import SloPlanner, SlotReserve, StepCost, resolve_targets, slack_s
from batchserve.core.speculative import SpeculationPlanner
from batchserve.core.step_builder import StepBuilder
from batchserve.core.stopping import stop_reason
from batchserve.request import FinishReason, Request, RequestStatus
from batchserve.sampling_params import InvalidRequestError

# waiting requests looked at past a head that the prefill caps hold back (the scan is per admission, per step)
LOOKAHEAD = 64


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        speculative: SpeculativeConfig | None = None,
        long_context_from: int | None = None,  # LongRoPE's original context (core/long_context.py)
        step_cost: StepCost | None = None,  # SLO predictions' step-time model (core/slo.py); None: learnt online
    ) -> None:
        config.validate()
        self.config = config
        self.kv = kv_cache
        self.capacity = CapacityPolicy(config, kv_cache)
        # no sequence may outgrow the whole pool: one alone would preempt itself and be readmitted for ever
        self._model_len_limit = max_model_len or config.max_model_len or 1 << 30
        self.kv_capacity_tokens = kv_cache.pool.num_blocks * kv_cache.block_size
        self.max_model_len = min(self._model_len_limit, self.kv_capacity_tokens)
        self.clock = clock
        self.waiting = make_request_queue(config.scheduling_order, config.max_wait_s, clock)
        if config.slo_admission == SloAdmission.DEPRIORITIZE:
            self.waiting = DemotingQueue(self.waiting)
        self.slo = SloPlanner(config, step_cost)
        self.reserve = SlotReserve(config.reserved_slots, config.max_batch_size, config.max_num_tokens)
        self._num_with_deadline = 0  # waiting or running requests with a queue deadline: checked each step
        self.running: list[Request] = []  # in rank order: the tail is preempted first
        self.requests: dict[str, Request] = {}
        self._forget: set[str] = set()  # ids the worker must drop at the next step
        self._padding: dict[str, Request] = {}  # static_padding: finished members of the current static batch
        self._rejected: list[RequestOutput] = []  # ended by schedule() (never schedulable), reported by the update
        self.num_preemptions_total = 0
        self.num_forced_preemptions = 0  # preemptions of a pinned request (_break_stall)
        self.last_step: StepBuilder | None = None
        # the speculative config as the engine runs it (batchserve/modes.py turns it off where a mode rules it out)
        self.speculation = SpeculationPlanner(speculative) if speculative is not None else None
        self.long_context_from = long_context_from
        self.adapters = AdapterGate(None)  # enable_lora: at most max_loras adapters a step (core/lora_schedule.py)

    # ---- requests in and out -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; InvalidRequestError if its prompt leaves no room for one token (the engine's limits
        refuse such prompts first, naming the limit)."""
        if not self.is_id_free(request.request_id):
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {request.num_prompt_tokens} tokens, the limit is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len}; the KV pool holds {self.kv_capacity_tokens} tokens)",
                "prompt",
            )
        mark_if_long(request, self.long_context_from)
        resolve_targets(request, self.config)
        self._admission_check(request)
        self._num_with_deadline += request.deadline is not None
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step's scheduled tokens and model time (the engine's or the simulator's), for the SLO step-time fit."""
        self.slo.cost.observe(num_tokens, seconds)

    def grow_kv_pool(self, num_blocks: int) -> None:
        """The worker's KV cache now holds num_blocks blocks, every block with content kept at its id: so does the
        pool, and the length limit follows."""
        self.kv.pool.grow(num_blocks)
        self.kv_capacity_tokens = num_blocks * self.kv.block_size
        self.max_model_len = min(self._model_len_limit, self.kv_capacity_tokens)

    def is_id_free(self, request_id: str) -> bool:
        """False while a request of that id is queued, running, or still computed as static batching's padding
        (the worker holds its state under that id until the batch is done)."""
        return request_id not in self.requests and request_id not in self._padding

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        return self.finish_requests(request_ids, FinishReason.ABORT)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> list[RequestOutput]:
        """End requests from outside the step (abort, a stop string found by the detokenizer)."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            (self.running if request in self.running else self.waiting).remove(request)
            self._finish(request, reason)
            outputs.append(RequestOutput(request_id, [], True, reason, request.stop_reason))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = StepBuilder(self.config.max_num_tokens, PrefillLimits.of(self.config))
        step.output.finished_req_ids, self._forget = self._forget, set()
        policy = self.config.scheduler_policy
        self.kv.waiting_needs.update(self.kv, self.waiting)  # eviction passes over what they will hit
        if len(self.waiting) and (self._num_with_deadline or self.slo.mode != SloAdmission.OFF):
            self._review_waiting()
        if policy == SchedulerPolicy.STATIC and not self.running:
            self._form_static_batch()
        if policy == SchedulerPolicy.MAX_UTILIZATION and self.config.scheduling_order == SchedulingOrder.PRIORITY:
            self._preempt_for_higher_priority(step)
        preempted_for_priority = step.num_preempted  # made room for the queue's head: it is admitted below
        self._schedule_running(step)
        if step.num_blocked and not step.num_seqs:
            self._break_stall(step)
        for request in self._padding.values():  # within the token budget (a member may end while others still prefill)
            if step.token_budget <= 0:
                break
            step.add_padding(request)
        if policy != SchedulerPolicy.STATIC and step.num_preempted == preempted_for_priority and not step.num_blocked:
            self._admit_waiting(step)  # not while running requests lose blocks: they would only lose more
        if not step.num_seqs and not self.running and step.num_preempted == 0 and len(self.waiting):
            self._reject_unschedulable(self.waiting.peek())
        step.output.finished_req_ids |= self._forget  # preempted this step
        self._forget = set()
        if self.speculation is not None:
            step.output.num_draft_tokens = self.speculation.num_model_drafts(len(self.running))
        if self.kv.tier is not None:  # the disk tier's reads and writes ride with the step (core/kv_offload.py)
            step.output.kv_loads, step.output.kv_saves = self.kv.tier.take_step_io()
        self.last_step = step
        return step.output

    def _schedule_running(self, step: StepBuilder) -> None:
        # decodes behind a long prefill keep one token of the budget each, so a prompt never stalls them
        pending_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        index = 0
        while index < len(self.running) and step.token_budget > 0 and step.num_seqs < self.config.max_batch_size:
            request = self.running[index]
            index += 1
            if outgrew_short_context(request, self.long_context_from):  # starts over, every token rotated long
                start_over(request, self.kv, self.long_context_from)
                self._forget.add(request.request_id)
            resumed = request.request_id not in self.kv.req_blocks
            hit = self._first_hit(request)
            is_decode = request.num_tokens - request.num_computed_tokens == 1
            pending_decodes -= is_decode
            if not step.limits.admits(request):
                continue  # a prefill over the step's caps waits; the decodes behind it do not
            budget = step.token_budget if is_decode else step.token_budget - pending_decodes
            num_tokens = self._tokens_to_schedule(request, hit, step.limits.cap(request, budget))
            if num_tokens == 0:
                continue
            drafts = self._drafts(request, budget) if is_decode and not resumed else []
            num_tokens += len(drafts)
            new_blocks = self._allocate_or_preempt(request, num_tokens, hit, step)
            if new_blocks is None:
                if request.status != RequestStatus.RUNNING:
                    return  # it preempted itself: nothing behind it is left
                continue
            self._on_scheduled(request)
            step.limits.count(request)
            step.add(request, num_tokens, self.kv.block_ids(request) if resumed else new_blocks, resumed)
            if drafts:
                step.output.spec_token_ids[request.request_id] = drafts

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Speculative tokens for a decode, only where their blocks are free now: a draft never preempts anyone."""
        if self.speculation is None:
            return []
        room = draft_room(request, self.long_context_from, self.max_model_len)
        drafts = self.speculation.propose(request, len(self.running), budget, room)
        if drafts and self.kv.blocks_needed(request, 1 + len(drafts)) > self.kv.pool.num_free_blocks:
            return []
        return drafts

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, hit: PrefixHit | None, step: StepBuilder
    ) -> list[int] | None:
        new_blocks = self.kv.allocate(request, num_tokens, hit)
        if self.config.scheduler_policy != SchedulerPolicy.MAX_UTILIZATION:
            return new_blocks  # reservations make failure impossible; never preempt under these policies
        while new_blocks is None:
            victim = self._pick_victim(request)
            if victim is None:
                step.num_blocked += 1  # it waits a step, keeping its blocks: the requests ahead of it free some
                return None
            self._preempt(victim, step)
            if victim is request:
                return None
            new_blocks = self.kv.allocate(request, num_tokens, hit)
        return new_blocks

    def _first_hit(self, request: Request) -> PrefixHit | None:
        """A prefix lookup for a request that holds no blocks yet (static batch members start that way)."""
        if self.kv.num_blocks_of(request) or request.num_computed_tokens:
            return None
        hit = self.kv.find_prefix_hit(request)
        if request.status == RequestStatus.RUNNING and request.first_scheduled_time is None:
            self.kv.record_prefix_query(request, hit)
            request.num_cached_prompt_tokens = hit.num_tokens
        return hit

    def _tokens_to_schedule(self, request: Request, hit: PrefixHit | None, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens - (hit.num_tokens if hit else 0)
        if budget <= 0 or (not self.config.enable_chunked_prefill and remaining > budget):
            return 0
        return min(remaining, budget)

    def _pick_victim(self, request: Request) -> Request | None:
        """Whom to preempt so that `request` gets its blocks: it or a request after it (those before it are in this step
        already). Pinned requests (preempted max_preemptions_per_request times) are passed over; under slo_admission
        the one with the most slack goes (ties: the lowest-ranked), else the lowest-ranked. None: only pinned ones are
        left after it, so it waits (_break_stall if nothing at all can run)."""
        after = self.running[self.running.index(request) :]
        candidates = [r for r in after if not self.capacity.is_pinned(r)]
        if not candidates:
            return None
        if self.config.slo_admission == SloAdmission.OFF:
            return candidates[-1]
        now = self.clock()
        return max(reversed(candidates), key=lambda r: slack_s(r, now))

    def _break_stall(self, step: StepBuilder) -> None:
        """Every running request waits for blocks that only pinned requests hold: the thrash guard gives way once,
        for the lowest-ranked, rather than stall the engine, and the step is scheduled again."""
        self.num_forced_preemptions += 1
        self._preempt(self.running[-1], step)
        step.num_blocked = 0
        self._schedule_running(step)

    def _next_admissible(self, limits: PrefillLimits, deferred: set[int]) -> Request | None:
        """The queue's head, or, when the prefill caps or the slot reserve hold it back, the first request within
        LOOKAHEAD they let in: a long prompt waiting for a long-prefill or a regular slot holds up no short one."""
        head = self.waiting.peek()
        if not (limits.active or self.adapters.active or self.reserve.active):  # deferred: prefixes read back
            return next((r for r in self.waiting if id(r) not in deferred), None) if id(head) in deferred else head
        self.adapters.track(self.running)  # recounted each time: a swapped-in request joins without a word
        now = self.clock()
        for request in itertools.chain((head,), itertools.islice(self.waiting, LOOKAHEAD)):
            if id(request) in deferred:
                continue
            admits = limits.admits(request) and self.adapters.admits(request, now)
            if admits and self.reserve.admits(request, self.running, now, limits, self.slo.cost):
                return request
            deferred.add(id(request))
        return None

    def _admit_waiting(self, step: StepBuilder) -> None:
        deferred: set[int] = set()
        while len(self.waiting) and step.token_budget > 0 and len(self.running) < self.config.max_batch_size:
            request = self._next_admissible(step.limits, deferred)
            if request is None:
                return
            if self.kv.is_swapped(request):
                if request is not self.waiting.peek() or not self._swap_in(request, step):
                    return
                continue
            hit = self.kv.find_prefix_hit(request)  # none for a request holding the blocks the tier reads back
            admits = self.capacity.admits(request, hit, self.running, self.max_model_len)
            if self.kv.reads_back(request, hit, wait=not (self.running or step.num_seqs), start=admits):
                if self.kv.is_loading(request):  # its blocks count as being computed meanwhile: the others go on
                    deferred.add(id(request))
                continue
            num_tokens = self._tokens_to_schedule(request, hit, step.limits.cap(request, step.token_budget))
            if num_tokens == 0 or not admits:
                return
            new_blocks = self.kv.allocate(request, num_tokens, hit)
            if new_blocks is None:
                return
            self.waiting.remove(request)
            step.limits.count(request)
            if request.status == RequestStatus.WAITING:
                self.kv.record_prefix_query(request, hit)
                request.num_cached_prompt_tokens = hit.num_tokens
            self._on_scheduled(request)
            self._insert_running(request)
            step.add(request, num_tokens, self.kv.block_ids(request), resumed=True)

    # ---- service-level targets (core/slo.py) ------------------------------------------------------------------
    def _admission_check(self, request: Request) -> None:
        self.slo.check_admission(request, self.running, self.waiting, self.clock())

    def _review_waiting(self) -> None:
        for request, why in self.slo.review_waiting(self.waiting, self.running, self.clock()):
            self._drop_waiting(request, why)

    def _drop_waiting(self, request: Request, why: str) -> None:
        self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        request.stop_reason = why
        self._rejected.append(RequestOutput(request.request_id, [], True, FinishReason.ABORT, why))

    def _reject_unschedulable(self, request: Request) -> None:
        """The head was not admitted into an empty batch on an empty pool, so it never will be (larger than the pool,
        or than a step's tokens without chunked prefill): it ends, aborted, instead of blocking the queue for ever."""
        self._drop_waiting(request, None)

    def _on_scheduled(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()

    def _insert_running(self, request: Request) -> None:
        if self.capacity.is_pinned(request):  # ranked first: everyone after it may give it blocks, it gives none
            self.running.insert(sum(1 for _ in itertools.takewhile(self.capacity.is_pinned, self.running)), request)
        elif self.config.scheduling_order == SchedulingOrder.PRIORITY:
            keys = [(r.priority, r.arrival_time) for r in self.running]
            self.running.insert(bisect.bisect_right(keys, (request.priority, request.arrival_time)), request)
        else:
            self.running.append(request)

    # ---- static batches, preemption, swaps (what fits: core/capacity.py) --------------------------------------
    def _form_static_batch(self) -> None:
        """Static batching: the next batch is up to max_batch_size waiting requests whose worst case fits."""
        while len(self.waiting) and len(self.running) < self.config.max_batch_size:
            request = self.waiting.peek()
            hit = self.kv.find_prefix_hit(request)
            if not self.capacity.reservation_fits(request, hit, self.running, self.max_model_len):
                break
            # hold the worst case now, as classic static batching does, so members never wait for blocks
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING

    def _preempt_for_higher_priority(self, step: StepBuilder) -> None:
        """A waiting request of higher priority (lower value) than the lowest running one takes its place when
        it could not otherwise be admitted."""
        while len(self.waiting) and self.running:
            candidate, victim = self.waiting.peek(), self.running[-1]
            if candidate.priority >= victim.priority:
                return
            hit = self.kv.find_prefix_hit(candidate)
            first_chunk = min(candidate.num_tokens - hit.num_tokens, self.config.max_num_tokens)
            room = self.kv.blocks_needed(candidate, first_chunk, hit) <= self.kv.pool.num_free_blocks
            if room and len(self.running) < self.config.max_batch_size:
                return
            self._preempt(victim, step)

    def _preempt(self, request: Request, step: StepBuilder) -> None:
        self.running.remove(request)
        swapped = self.config.preemption_mode == PreemptionMode.SWAP and self.kv.can_swap_out(request)
        if swapped:
            step.output.blocks_to_swap_out += self.kv.swap_out(request)
            request.status = RequestStatus.SWAPPED
        else:
            start_over(request, self.kv, self.long_context_from)
            request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        step.num_preempted += 1
        self._forget.add(request.request_id)
        self.waiting.push_front(request)

    def _swap_in(self, request: Request, step: StepBuilder) -> bool:
        # never in a step that swaps out: a host block freed here could be overwritten before it is read
        if step.output.blocks_to_swap_out:
            return False
        num_tokens = min(request.num_tokens - request.num_computed_tokens, step.token_budget)
        if not self.capacity.reservation_fits(request, PrefixHit([], 0), self.running, self.max_model_len):
            return False
        plan = self.kv.plan_swap_in(request, num_tokens)
        if plan is None:
            return False
        self.waiting.pop()
        step.output.blocks_to_swap_in += plan.pairs
        self._on_scheduled(request)
        self._insert_running(request)
        step.add(request, num_tokens, plan.new_block_ids, resumed=True)
        return True

    # ---- after the forward pass -------------------------------------------------------------------------------
    def update_from_output(self, scheduled: SchedulerOutput, model_output: ModelOutput) -> list[RequestOutput]:
        for request_id, num_tokens in scheduled.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.num_computed_tokens += num_tokens
        outputs, self._rejected = self._rejected, []
        logprobs = model_output.logprobs or [None] * len(model_output.req_ids)
        for request_id, token_id, logprob in zip(model_output.req_ids, model_output.sampled_token_ids, logprobs):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            accepted = self._verified(request, scheduled, model_output)
            outputs.append(self._append_tokens(request, accepted + [token_id], logprob))
        if self.speculation is not None:
            self.speculation.keep_model_drafts(model_output.draft_token_ids, self.requests)
        return outputs

    def _verified(self, request: Request, scheduled: SchedulerOutput, model_output: ModelOutput) -> list[int]:
        """The accepted drafts of a speculated request; the rejected ones' K/V is dropped (computed count and the
        blocks past it)."""
        drafts = scheduled.spec_token_ids.get(request.request_id)
        if not drafts:
            return []
        accepted = model_output.accepted_token_ids.get(request.request_id, [])
        request.num_computed_tokens -= len(drafts) - len(accepted)
        self.kv.trim(request)
        self.speculation.record(len(drafts), len(accepted))
        return accepted

    def _append_tokens(self, request: Request, token_ids: list[int], logprob) -> RequestOutput:
        """Append a step's tokens (one, or several after speculation) up to the first that ends the request."""
        reason = None
        for count, token_id in enumerate(token_ids, 1):
            request.output_token_ids.append(token_id)
            reason = stop_reason(request, token_id, self.max_model_len)
            if reason is not None:
                token_ids = token_ids[:count]
                break
        if request.first_token_time is None:
            request.first_token_time = self.clock()
        if reason is not None:
            self.running.remove(request)
            self._finish(request, reason)
        return RequestOutput(
            request.request_id,
            token_ids,
            reason is not None,
            reason,
            request.stop_reason,
            [logprob] if logprob is not None else [],
        )

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._num_with_deadline -= request.deadline is not None
        batch_member = request.status == RequestStatus.RUNNING and request.num_computed_tokens > 0
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = self.clock()
        del self.requests[request.request_id]
        if self.speculation is not None:
            self.speculation.finished(request)
        static = self.config.scheduler_policy == SchedulerPolicy.STATIC
        if static and self.config.static_padding and batch_member:
            self._padding[request.request_id] = request  # keeps its blocks and its worker row until the batch is done
        else:
            self._release(request)
        if static and not self.running:
            for member in self._padding.values():
                self._release(member)
            self._padding = {}

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self._forget.add(request.request_id)

    def stats(self) -> SchedulerStats:
        return scheduler_stats(self)  # core/scheduler_stats.py
