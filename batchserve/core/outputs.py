"""The only contract between the scheduler and the worker: plain dataclasses, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchserve.request import FinishReason
from batchserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has no state for: first admission, or resumed after a recompute preemption."""

    req_id: str
    token_ids: list[int]  # prompt + tokens generated before a preemption
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt (penalties tell the two apart)
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # K/V already in the cache (prefix-cache hit or swapped-in)
    lora_id: int = 0  # its adapter (worker/lora_slots.py); 0: the base model


@dataclass
class CachedRequestData:
    """A request the worker already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step, in batch order (new requests first, then cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # the worker forgets these (finished, aborted, preempted since the last step)
    finished_req_ids: set[str] = field(default_factory=set)
    # (device block id, host block id) pairs to copy before the forward pass
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # static batching's padding: finished batch members recomputing their last position; the worker runs them as
    # decodes over their context, writes their K/V nowhere and samples nothing for them
    padding_req_ids: set[str] = field(default_factory=set)
    # speculative decoding: req_id -> draft tokens scheduled after its last known token (its scheduled count is
    # 1 + len(drafts)); the worker verifies them against the target's own predictions
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # speculative method draft_model: how many tokens the draft model proposes, after this step, for the next one
    num_draft_tokens: int = 0
    # the disk tier (core/kv_offload.py): (block id, checked payload) copied into the pool before the forward pass;
    # blocks the step fills that the worker copies after it and writes to the tier off the step path
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)
    kv_saves: list = field(default_factory=list)  # of core.kv_offload.TierSave

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class Logprobs:
    """Log-probability of the sampled token and the top-k alternatives at one position."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: dict[int, float]  # token id -> logprob of the top-k tokens


@dataclass
class ModelOutput:
    """What one forward pass produced: one sampled token per request that completed its known tokens."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs | None] | None = None  # parallel to req_ids when any request asked for them
    # req_id -> a score per prompt token (None for the first), with the request's first sampled token
    prompt_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)
    # speculative decoding: req_id -> the accepted prefix of its drafts; its sampled token follows them
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # speculative method draft_model: req_id -> the draft model's proposal to follow this step's tokens
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # pooling requests whose prompt is done: req_id -> its result (a float32 host tensor: embedding or label scores)
    pooled: dict[str, object] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """One request's progress after a step: the tokens it gained, and whether it is done."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[Logprobs] = field(default_factory=list)


@dataclass
class SchedulerStats:
    """A snapshot the scheduler takes after deciding a step: what a dashboard or a trace shows."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0  # waiting requests whose KV sits in host memory
    num_preempted_this_step: int = 0
    num_preemptions_total: int = 0
    # SLO admission since start (core/slo.py): refused (at arrival or while waiting), demoted, dropped at a deadline
    slo_num_refused: int = 0
    slo_num_demoted: int = 0
    slo_num_deadline_dropped: int = 0
    num_prefill_tokens: int = 0  # prompt (or recompute) tokens computed this step
    num_decode_tokens: int = 0  # generated-token positions computed this step
    num_scheduled_seqs: int = 0
    max_batch_size: int = 1
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # owned by at least one request
    kv_blocks_cached_free: int = 0  # free but still holding reusable prefix content
    kv_blocks_free: int = 0  # free, cached or not
    kv_slots_allocated: int = 0  # token slots in the blocks of running requests
    kv_slots_filled: int = 0  # of which hold a computed token
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of which were found, since start
    # req_id -> (tokens scheduled, is a prefill chunk) for this step, in batch order
    scheduled: dict[str, tuple[int, bool]] = field(default_factory=dict)
    padding: list[str] = field(default_factory=list)  # static batching: finished members computed as padding
    # speculative decoding, since start: draft tokens proposed, accepted, verification steps, tokens they emitted
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_emitted_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def batch_occupancy(self) -> float:
        return self.num_scheduled_seqs / self.max_batch_size

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def internal_fragmentation(self) -> float:
        """Share of allocated token slots that hold nothing yet (the tail of each sequence's last block)."""
        return 1.0 - self.kv_slots_filled / self.kv_slots_allocated if self.kv_slots_allocated else 0.0


@dataclass
class RunnerTimings:
    """Host wall time of one execute() by phase, in seconds. On an accelerator `forward_s` is the launch time and the
    wait for the results lands in `sample_s` (its .tolist() is the step's one synchronisation)."""

    prepare_s: float = 0.0  # swaps, request table updates, building the packed batch
    forward_s: float = 0.0  # the model and the logits
    sample_s: float = 0.0  # sampling metadata, the sampler, the sampled ids back to the host

    @property
    def model_s(self) -> float:
        """The step's time on the runner: what a step-time model predicts."""
        return self.prepare_s + self.forward_s + self.sample_s
