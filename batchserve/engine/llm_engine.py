"""The engine: requests admitted as built (engine/inputs.RequestBuilder checked them), then schedule -> execute ->
update, one forward pass per step(), each returning a CompletionDelta per request that progressed."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from transformers import PreTrainedTokenizerBase

from batchserve import modes
from batchserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from batchserve.core.build import build_scheduler
from batchserve.core.kv_cache_manager import cdiv
from batchserve.core.lora_schedule import AdapterGate
from batchserve.core.outputs import (
    Logprobs,
    ModelOutput,
    RequestOutput,
    RunnerTimings,
    SchedulerOutput,
    SchedulerStats,
)
from batchserve.engine.detokenizer import IncrementalDetokenizer
from batchserve.engine.errors import QueueFullError
from batchserve.engine.inputs import EngineLimits, Prompt, RequestBuilder
from batchserve.engine.lora_registry import LoRARegistry, UnknownAdapterError
from batchserve.engine.outputs import CompletionDelta, RequestMetrics
from batchserve.engine.pooling import check_runner_task
from batchserve.engine.startup import load_runner
from batchserve.models.default_model import DEFAULT_MODEL_FILE
from batchserve.request import EngineRequest, FinishReason, LoRARequest, Request
from batchserve.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from batchserve.models.lora_adapters import LoRAAdapter

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine drives. A runner whose pool can grow has, besides, `max_kv_blocks` (the most it may hold)
    and `resize_kv_cache(num_blocks, keep_block_ids)` (ModelRunner, FakeRunner); one without them has a fixed pool."""

    num_kv_blocks: int
    num_swap_blocks: int
    last_timings: RunnerTimings  # of the latest execute()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput: ...


@dataclass
class StepTimings:
    """Where one engine step's wall time went, in seconds: everything but `forward_s` is host-side overhead."""

    schedule_s: float = 0.0  # the scheduler's decision (admission, preemption, block allocation)
    prepare_s: float = 0.0  # the runner's input preparation
    forward_s: float = 0.0  # the model's forward pass and the logits
    sample_s: float = 0.0  # sampling
    output_s: float = 0.0  # scheduler update, detokenization, the step's outputs

    @classmethod
    def of(cls, schedule_s: float, runner: RunnerTimings, output_s: float) -> StepTimings:
        return cls(schedule_s, runner.prepare_s, runner.forward_s, runner.sample_s, output_s)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.output_s


@dataclass
class StepRecord:
    index: int
    start_time: float
    end_time: float
    stats: SchedulerStats


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    wants_logprobs: bool
    new_token_ids: list[int] = field(default_factory=list)  # since the request's last delta
    new_logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None  # until its next delta carries them
    pooled: object | None = None  # a pooling request's result (engine/pooling.py), carried by its final delta


def _mode_facts_of(config: EngineConfig, model_config: ModelConfig, runner: Runner) -> modes.ModeFacts:
    """The mode table's facts for a runner built elsewhere (a test's, a fake): its device and dtype where it has them,
    the host's kernels taken as present (a runner already built has chosen its paths)."""
    device = getattr(runner, "device", None)
    dtype = getattr(runner, "dtype", None)
    return modes.ModeFacts.of(
        config,
        model_config,
        getattr(device, "type", "cpu"),
        str(dtype).removeprefix("torch.") if dtype is not None else str(config.dtype),
        native_kernels=True,
    )


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        model_config: ModelConfig | None = None,
        initial_kv_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`initial_kv_blocks`: allocate only that many KV blocks now (a runner loaded here), and grow the pool to
        what the requests need (reserve_kv_blocks, add_request) up to what num_kv_blocks or the memory fraction
        allows; None: all of that now, as a server does. The limits (max_model_len) are those of the whole budget.
        `clock`: what the scheduler's decisions and the step times are measured on (a benchmark on a shared host may
        give the engine thread's CPU time, which other processes' turns on the core do not advance)."""
        config.validate()
        self.config, self.clock = config, clock
        if runner is None:
            # torch only when a real model is asked for
            runner, model_config, tokenizer = load_runner(config, initial_kv_blocks)
        assert model_config is not None and tokenizer is not None
        self.runner, self.model_config, self.tokenizer = runner, model_config, tokenizer
        # the mode table's decision: load_runner's, made before loading; for a runner built elsewhere, made now
        self.modes: modes.ModeDecision = getattr(runner, "modes", None) or modes.enforce(
            config, _mode_facts_of(config, model_config, runner)
        )
        self.limits = EngineLimits.of(config, model_config, self.max_kv_blocks * config.cache.block_size)
        self.requests = RequestBuilder(tokenizer, self.limits)
        self.scheduler = build_scheduler(
            config.scheduler,
            config.cache,
            runner.num_kv_blocks,
            runner.num_swap_blocks,
            self.limits.max_model_len,
            clock,
            speculative=SpeculativeConfig.from_value(config.speculative_config),
            sliding_window=model_config.sliding_window,  # set only when every layer is windowed (ModelConfig)
            long_context_from=model_config.long_context_from,
        )
        self.kv_tier = None  # the disk tier under the pool (docs/kv-offload.md), for a runner with a real KV cache
        if config.cache.kv_offload_dir and hasattr(runner, "kv_cache"):
            from batchserve.worker.kv_offload import attach_tier

            self.kv_tier = attach_tier(config, runner, self.scheduler.kv)
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.loras = self._serve_adapters(config)
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[RequestOutput] = []  # finished outside a step (aborts), reported at the next step
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_stats: SchedulerStats | None = None
        self.last_step_time_s = 0.0
        self.last_timings = StepTimings()
        self.step_records: list[StepRecord] | None = [] if config.record_steps else None
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens%s; max_model_len %d",
            runner.num_kv_blocks,
            config.cache.block_size,
            runner.num_kv_blocks * config.cache.block_size,
            f", sized to the requests up to {self.max_kv_blocks} blocks" if self.kv_pool_can_grow else "",
            self.limits.max_model_len,
        )
        logger.info("effective config: %s", ", ".join(f"{k}={v}" for k, v in self.effective_config().items()))

    @classmethod
    def from_options(cls, **options: Any) -> LLMEngine:
        return cls(EngineConfig.from_options(**options))

    def effective_config(self) -> dict[str, Any]:
        """Every option as the engine runs it: what was left to the engine (the pool's size, the context, the
        device and dtype) resolved, enum members as their strings. Logged at start-up and exported as a metric."""
        flat = {k: str(v) if v is not None else None for k, v in self.config.to_flat_dict().items()}
        resolved = {
            "num_kv_blocks": self.runner.num_kv_blocks,
            "num_swap_blocks": self.runner.num_swap_blocks,
            "max_model_len": self.limits.max_model_len,
            "max_input_len": self.limits.max_input_len,
            "device": getattr(self.runner, "device", None),  # a test double may have neither
            "dtype": str(getattr(self.runner, "dtype", "")).removeprefix("torch.") or None,
        }
        flat.update({k: str(v) for k, v in resolved.items() if v is not None})
        if flat.get("model") is None:  # None would read as "no model" in the log and the config metric
            flat["model"] = f"{DEFAULT_MODEL_FILE} (the default)"
        return flat

    # ---- the KV pool -------------------------------------------------------------------------------------------
    @property
    def max_kv_blocks(self) -> int:
        """The most blocks the KV pool may hold: the runner's budget; its size now for a fixed pool."""
        return getattr(self.runner, "max_kv_blocks", self.runner.num_kv_blocks)

    @property
    def kv_pool_can_grow(self) -> bool:
        return self.runner.num_kv_blocks < self.max_kv_blocks

    def worst_case_blocks(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Blocks a request holds at its longest: prompt and output, within max_model_len."""
        return cdiv(min(num_prompt_tokens + max_tokens, self.limits.max_model_len), self.config.cache.block_size)

    def reserve_kv_for(self, requests: Sequence[tuple[int, int]]) -> int:
        """Grow the pool (when it may) to the worst case of these (prompt tokens, max_tokens) requests all running
        at once: the sum over the max_batch_size largest, at most max_kv_blocks. Returns the pool's size."""
        worst = sorted((self.worst_case_blocks(n, m) for n, m in requests), reverse=True)
        return self.reserve_kv_blocks(sum(worst[: self.config.scheduler.max_batch_size]))

    def reserve_kv_blocks(self, num_blocks: int) -> int:
        """Grow the KV pool to num_blocks, at most max_kv_blocks (a fixed pool stays as it is); it never shrinks.
        Between steps. The blocks held by a request or cached for a prefix keep their K/V (the runner sets them
        aside while it reallocates), so a grown pool still hits the prefixes of earlier requests. Returns the pool's
        size."""
        current, target = self.runner.num_kv_blocks, min(num_blocks, self.max_kv_blocks)
        if target <= current:
            return current
        keep = self.scheduler.kv.pool.block_ids_with_content()
        self.runner.resize_kv_cache(target, keep)  # type: ignore[attr-defined]
        self.scheduler.grow_kv_pool(target)
        logger.info("KV pool: %d -> %d blocks (at most %d)", current, target, self.max_kv_blocks)
        return target

    # ---- requests in ------------------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> str:
        """Admit a request built by RequestBuilder (`self.requests`), which checked it; refused here only for what
        the engine's state decides: an id in use, a full waiting queue."""
        request_id, params = request.request_id, request.sampling_params
        pooler = getattr(self.runner, "pooler", None)
        check_runner_task(self.config, params, pooler is None or pooler.config.generates)
        if request_id in self._tracked or not self.scheduler.is_id_free(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and self.scheduler.num_waiting >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
            context=request.prompt_token_ids,
        )
        if self.kv_pool_can_grow:  # room for this request at its longest (LLM.generate reserved a whole batch's)
            self.reserve_kv_blocks(self.worst_case_blocks(request.num_prompt_tokens, params.max_tokens))
        scheduled = Request.of(request, self.eos_token_ids)
        if params.lora_name is not None:  # its adapter, by name (engine/lora_registry.py)
            scheduled.lora_id = self._adapter(params.lora_name).lora_int_id
        self.scheduler.add_request(scheduled)
        self._tracked[request_id] = _Tracked(scheduled, detokenizer, params.logprobs is not None)
        return request_id

    def _serve_adapters(self, config: EngineConfig) -> LoRARegistry | None:
        """enable_lora: the adapters of lora_modules loaded, the scheduler held to max_loras a step."""
        pool = getattr(self.runner, "lora", None)
        if pool is None:
            return None
        registry = LoRARegistry(pool)
        registry.add_modules(config.lora_modules)
        self.scheduler.adapters = AdapterGate(config.max_loras)
        return registry

    def _adapter(self, name: str) -> LoRARequest:
        if self.loras is None:
            raise UnknownAdapterError(name)
        return self.loras.resolve(name)

    def read_lora(self, lora: LoRARequest) -> LoRAAdapter:
        """An adapter's folder read and checked against the base (any thread: nothing of the engine changes)."""
        if self.loras is None:
            raise InvalidRequestError("LoRA adapters need enable_lora", "lora")
        self.loras.check_name(lora)
        return self.loras.pool.read(lora)

    def add_lora(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRARequest:
        """Serve an adapter from now on (`adapter`: its folder as read_lora read it; else read now). LoRALoadError
        names what does not fit the base."""
        if self.loras is None:
            raise InvalidRequestError("LoRA adapters need enable_lora", "lora")
        return self.loras.add(lora, adapter)

    def lora_names(self) -> tuple[str, ...]:
        """The adapters served now (any thread: a snapshot)."""
        return tuple(lora.lora_name for lora in self.list_loras())

    def remove_lora(self, name: str) -> None:
        """New requests for `name` are refused from now on; those running with it finish with it."""
        if self.loras is None:
            raise UnknownAdapterError(name)
        self.loras.remove(name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters served now (any thread: a snapshot)."""
        return [] if self.loras is None else list(self.loras.served)

    def add_prompt(
        self,
        request_id: str | None,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        """Build a request (`self.requests`, tokenizing a text here) and add it: for scripts and benchmarks that
        drive the engine directly. A None id is given one; a None arrival is now on the engine's clock."""
        request_id = request_id if request_id is not None else self.new_request_id()
        arrival_time = self.clock() if arrival_time is None else arrival_time
        return self.add_request(self.requests.from_prompt(request_id, prompt, sampling_params, priority, arrival_time))

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._pending += self.scheduler.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def close(self) -> None:
        """Stop the runner's helper threads, if it has any (a runner without `close` holds none)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        if self.kv_tier is not None:
            self.kv_tier.close()

    # ---- one step -----------------------------------------------------------------------------------------------
    def step(self) -> list[CompletionDelta]:
        start = self.clock()
        scheduled = self.scheduler.schedule()
        scheduled_at = self.clock()
        model_output = self.runner.execute(scheduled)
        executed_at = self.clock()
        if not scheduled.is_empty:  # the SLO predictions' step-time fit (core/slo.py), on the scheduler's clock
            self.scheduler.observe_step(scheduled.total_num_scheduled_tokens, executed_at - scheduled_at)
        if self.scheduler.speculation is not None and not scheduled.is_empty:  # k_policy "cost" learns step costs
            self.scheduler.speculation.observe_step(scheduled.total_num_scheduled_tokens, executed_at - scheduled_at)
        for request_id, scores in model_output.prompt_logprobs.items():
            if request_id in self._tracked:
                self._tracked[request_id].prompt_logprobs = scores
        request_outputs = self._pending + self.scheduler.update_from_output(scheduled, model_output)
        if model_output.pooled:  # a pooling request ends with its prompt: its result instead of a token
            for request_id, pooled in model_output.pooled.items():
                if request_id in self._tracked:
                    self._tracked[request_id].pooled = pooled
            request_outputs += self.scheduler.finish_requests(model_output.pooled, FinishReason.STOP)
        self._pending = []
        results = self._process(request_outputs)
        end = self.clock()
        self.last_stats = self.scheduler.stats()
        self.last_step_time_s = end - start
        self.last_timings = StepTimings.of(scheduled_at - start, self.runner.last_timings, end - executed_at)
        if self.step_records is not None and not scheduled.is_empty:
            self.step_records.append(StepRecord(self.num_steps, start, end, self.last_stats))
        self.num_steps += 1
        return results

    def _process(self, request_outputs: list[RequestOutput]) -> list[CompletionDelta]:
        stopped = []
        for out in request_outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            for count, token_id in enumerate(out.new_token_ids, 1):
                tracked.detokenizer.add_token(token_id)
                if tracked.detokenizer.stopped_by is not None:  # a step may bring several tokens (speculation)
                    out.new_token_ids = out.new_token_ids[:count]
                    break
            tracked.new_token_ids += out.new_token_ids
            if tracked.wants_logprobs:
                tracked.new_logprobs += out.new_logprobs
            if tracked.detokenizer.stopped_by is not None and not out.finished:
                stopped.append(out.request_id)
        if stopped:  # a stop string ends the request as EOS would
            for out in self.scheduler.finish_requests(stopped, FinishReason.STOP):
                out.stop_reason = self._tracked[out.request_id].detokenizer.stopped_by
                request_outputs.append(out)
        finals: dict[str, RequestOutput] = {}
        for out in request_outputs:
            if out.request_id in self._tracked and (out.finished or out.request_id not in finals):
                finals[out.request_id] = out
        return [self._delta(rid, out) for rid, out in finals.items()]

    def _delta(self, request_id: str, out: RequestOutput) -> CompletionDelta:
        tracked = self._tracked[request_id]
        request = tracked.request
        if out.finished:
            del self._tracked[request_id]
        delta_ids, tracked.new_token_ids = tracked.new_token_ids, []
        delta_logprobs, tracked.new_logprobs = tracked.new_logprobs, []
        prompt_logprobs, tracked.prompt_logprobs = tracked.prompt_logprobs, None
        return CompletionDelta(
            request_id=request_id,
            delta_token_ids=delta_ids,
            delta_text=tracked.detokenizer.take_delta(out.finished),
            delta_logprobs=delta_logprobs if tracked.wants_logprobs else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            finished=out.finished,
            finish_reason=out.finish_reason.value if out.finish_reason else None,
            stop_reason=tracked.detokenizer.stopped_by or out.stop_reason,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                finished_time=request.finished_time,
                num_cached_tokens=request.num_cached_prompt_tokens,
                num_preemptions=request.num_preemptions,
                ttft_slo_s=request.ttft_slo_s,
                tpot_slo_s=request.tpot_slo_s,
            ),
            prompt_logprobs=prompt_logprobs,
            pooled=tracked.pooled,
            lora_name=request.sampling_params.lora_name,
        )
