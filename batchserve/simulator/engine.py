"""An engine-shaped object around the REAL Scheduler and KVCacheManager: `step()` is LLMEngine.step's schedule ->
execute -> update_from_output, with a runner that runs no model. It advances a virtual clock by the profile's step
time and samples a placeholder token; output lengths come from each request's max_tokens (the workload's, with
ignore_eos). No tokenizer or detokenizer: the simulator needs token counts, not text."""

from __future__ import annotations

from dataclasses import dataclass

from batchserve import modes
from batchserve.config import EngineConfig
from batchserve.core.build import build_scheduler
from batchserve.core.lora_schedule import AdapterGate
from batchserve.core.outputs import ModelOutput, RunnerTimings, SchedulerOutput, SchedulerStats
from batchserve.core.scheduler import Scheduler
from batchserve.request import Request
from batchserve.sampling_params import SamplingParams
from batchserve.simulator.clock import VirtualClock
from batchserve.simulator.shape import StepShape, shape_of
from batchserve.simulator.speculation import DraftAcceptance, as_modelled
from batchserve.simulator.step_model import StepTimeModel

PLACEHOLDER_TOKEN = 0  # what the simulated model "samples"; never an EOS id of the simulated engine (it has none)


class TimedRunner:
    """The runner the simulator gives the scheduler: a step costs what the profile predicts for its shape."""

    def __init__(self, step_model: StepTimeModel, clock: VirtualClock, scheduler: Scheduler, num_kv_blocks: int,
                 num_swap_blocks: int = 0, acceptance: DraftAcceptance | None = None) -> None:  # fmt: skip
        self.step_model, self.clock, self.scheduler = step_model, clock, scheduler
        self.acceptance = acceptance  # speculative decoding (simulator/speculation.py); None: off
        self.num_kv_blocks, self.num_swap_blocks = num_kv_blocks, num_swap_blocks
        self.last_timings = RunnerTimings()
        self.last_shape = StepShape()
        self.busy_s = 0.0
        self.recorded: list[SchedulerOutput] | None = None  # set to [] to keep every step's decisions (tests)

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        sampled: list[str] = []
        if self.recorded is not None:
            self.recorded.append(out)
        self.last_shape = shape_of(out, self.scheduler, sampled)
        tier = self.scheduler.kv.tier  # simulator/kv_tier.py: reads cost the step that loads them, writes are free
        for save in out.kv_saves if tier is not None else ():
            tier.store.put(save.digest)
        if not out.is_empty:
            seconds = self.step_model.predict(self.last_shape)
            seconds += len(out.kv_loads) * tier.store.read_s_per_block if tier is not None else 0.0
            self.last_timings = RunnerTimings(forward_s=seconds)
            self.busy_s += seconds
            self.clock.advance(seconds)
        output = ModelOutput(req_ids=sampled, sampled_token_ids=[PLACEHOLDER_TOKEN] * len(sampled))
        if self.acceptance is not None:
            self._speculate(out, output)
        return output

    def _speculate(self, out: SchedulerOutput, output: ModelOutput) -> None:
        """Kept drafts of this step's verified decodes, and the drafts every sampled sequence proposes for the next."""
        for req_id, drafts in out.spec_token_ids.items():
            output.accepted_token_ids[req_id] = [PLACEHOLDER_TOKEN] * self.acceptance.draw(len(drafts))
        if out.num_draft_tokens:
            output.draft_token_ids = {req_id: [PLACEHOLDER_TOKEN] * out.num_draft_tokens for req_id in output.req_ids}


@dataclass(slots=True)
class SimMetrics:
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class SimOutput:
    """The fields of engine.outputs.CompletionDelta that the bench driver reads (and the token list so far)."""

    request_id: str
    token_ids: list[int]
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: SimMetrics | None = None  # set when finished


class SimEngine:
    """One simulated replica. `scheduler` is batchserve.core's Scheduler, built by core.build as LLMEngine's is."""

    def __init__(self, config: EngineConfig, step_model: StepTimeModel, num_kv_blocks: int, max_model_len: int,
                 clock: VirtualClock | None = None, num_swap_blocks: int = 0,
                 acceptance_rate: float | None = None) -> None:  # fmt: skip
        """acceptance_rate: the share of drafts kept, as measured (`batchserve bench`), needed when the config
        speculates (simulator/speculation.py)."""
        config.validate()
        self.config = config
        self.clock = clock or VirtualClock()
        cache = config.cache
        limit = min(max_model_len, config.scheduler.max_model_len or max_model_len, num_kv_blocks * cache.block_size)
        self.max_model_len = limit
        speculative = modes.effective_speculation(config)  # as the engine would run it (static: off)
        acceptance = None
        if speculative is not None:
            if acceptance_rate is None:
                raise ValueError("simulating speculative decoding needs the measured acceptance rate "
                                 "(--spec-acceptance-rate; `batchserve bench` prints it for a workload)")  # fmt: skip
            acceptance = DraftAcceptance(acceptance_rate, speculative.num_speculative_tokens)
            speculative = as_modelled(speculative)
        self.scheduler = build_scheduler(config.scheduler, cache, num_kv_blocks, num_swap_blocks, limit, self.clock,
                                         speculative)  # fmt: skip
        if config.enable_lora:  # as LLMEngine: at most max_loras adapters a step
            self.scheduler.adapters = AdapterGate(config.max_loras)
        self.runner = TimedRunner(step_model, self.clock, self.scheduler, num_kv_blocks, num_swap_blocks, acceptance)
        self.last_stats: SchedulerStats | None = None
        self.num_steps = 0
        self._live: dict[str, Request] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, lora_id: int = 0) -> str:  # fmt: skip
        """As LLMEngine.add_request for token ids (`lora_id`: its adapter, 0 for the base model); a prompt over the
        engine's limit raises InvalidRequestError."""
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=sampling_params,
            eos_token_ids=(), priority=priority, arrival_time=self.clock() if arrival_time is None else arrival_time,
            lora_id=lora_id,
        )  # fmt: skip
        self.scheduler.add_request(request)
        self._live[request_id] = request
        return request_id

    add_prompt = add_request  # LLMEngine's name for a prompt given as it is (bench's OfflineRun drives both)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    def step(self) -> list[SimOutput]:
        scheduled = self.scheduler.schedule()
        model_output = self.runner.execute(scheduled)
        if not scheduled.is_empty:  # as LLMEngine.step: the SLO predictions learn the step's time
            self.scheduler.observe_step(scheduled.total_num_scheduled_tokens, self.runner.last_timings.model_s)
        request_outputs = self.scheduler.update_from_output(scheduled, model_output)
        self.last_stats = self.scheduler.stats()
        self.num_steps += 1
        results = []
        for out in request_outputs:
            request = self._live.get(out.request_id)
            if request is None:
                continue
            if out.finished:
                del self._live[out.request_id]
            reason = metrics = None
            if out.finished:  # only a finished request's counts are read: no object per token otherwise
                reason = out.finish_reason.value if out.finish_reason else None
                metrics = SimMetrics(request.num_cached_prompt_tokens, request.num_preemptions)
            results.append(SimOutput(out.request_id, request.output_token_ids, out.new_token_ids, out.finished,
                                     reason, metrics))  # fmt: skip
        return results
