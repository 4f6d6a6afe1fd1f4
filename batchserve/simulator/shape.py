"""What a step's duration depends on, read from a SchedulerOutput: the features every step-time model uses."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from batchserve.core.block_pool import KVBlock
from batchserve.core.outputs import SchedulerOutput
from batchserve.core.scheduler import Scheduler

FEATURES = (
    "steps", "tokens", "seqs", "samples", "decode_ctx", "prefill_pairs", "prefill_seqs", "mixed", "decode_ctx_distinct",
    "multi_row",
)  # fmt: skip


@dataclass
class StepShape:
    """One forward pass, in the units its cost scales with."""

    tokens: int = 0  # rows through every projection and MLP (prefill chunk tokens + decode tokens + padding)
    seqs: int = 0  # sequences in the batch (per-sequence host work: batch building, metadata)
    samples: int = 0  # rows that reach the LM head and the sampler (a request that completes its known tokens)
    decode_ctx: int = 0  # K/V positions read by single-token rows (the decode attention's memory traffic)
    prefill_pairs: int = 0  # query x key pairs of prefill chunks (causal within the chunk, all of the context before)
    prefill_ctx: int = 0  # K/V positions read by prefill chunks (their context before the chunk plus the chunk)
    swapped_blocks: int = 0  # blocks copied between the device and the host pool
    prefill_seqs: int = 0  # sequences with a prefill chunk (attention's per-sequence set-up, one SDPA call per layer)
    # K/V positions read by decode rows in blocks no other decode row of the step read before: a prefix block shared
    # by many decodes comes from memory once and from cache after, so the first read costs more than the others
    decode_ctx_distinct: int = 0
    # rows of requests with a LoRA adapter, and the distinct adapters among them: each group adds its shrink and
    # expand to every target projection (lora_cost.py prices them; the fitted profile's features leave them out)
    lora_tokens: int = 0
    lora_groups: int = 0

    def features(self) -> list[float]:
        """The regressors of the linear model, in FEATURES order (`steps` is the constant term)."""
        mixed = float(self.kind == "mixed")  # both attention paths run, their outputs merged, in every layer
        # a one-row step's projections are matrix-vector products, which stream the weights at the memory's rate; two
        # rows or more take the GEMM kernels, which on some CPUs cost a step more even at two rows (float32 on AVX2)
        multi_row = float(self.tokens > 1)
        return [
            1.0,
            self.tokens,
            self.seqs,
            self.samples,
            self.decode_ctx,
            self.prefill_pairs,
            self.prefill_seqs,
            mixed,
            self.decode_ctx_distinct,
            multi_row,
        ]

    @property
    def kind(self) -> str:
        """decode (one token per sequence), prefill (chunks only) or mixed: steps whose time a model may miss
        differently."""
        if not self.prefill_pairs:
            return "decode"
        return "mixed" if self.decode_ctx else "prefill"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def shape_of(out: SchedulerOutput, scheduler: Scheduler, sampled: list[str] | None = None) -> StepShape:
    """The shape of the step `scheduler` just scheduled as `out` (before its update: each request's known tokens
    decide whether the runner samples for it, its blocks which K/V a decode reads); the ids the runner samples for are
    appended to `sampled` (batch order)."""
    start = {n.req_id: n.num_computed_tokens for n in out.new_requests}
    start.update({c.req_id: c.num_computed_tokens for c in out.cached_requests})
    s = StepShape(swapped_blocks=len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out))
    requests, kv = scheduler.requests, scheduler.kv
    shared = kv.pool.enable_caching  # without the prefix cache no two sequences hold the same block
    decode_blocks: set[KVBlock] = set()  # by identity: one physical block each
    decode_block_reads = 0
    adapters: set[int] = set()
    for rid, n in out.num_scheduled_tokens.items():
        c = start[rid]
        s.tokens += n
        s.seqs += 1
        if rid in out.padding_req_ids:
            s.decode_ctx += c + 1  # padding runs as a decode over its context and samples nothing
            continue
        if requests[rid].lora_id:
            s.lora_tokens += n
            adapters.add(requests[rid].lora_id)
        if n == 1:
            s.decode_ctx += c + 1
            if shared:
                read = kv.blocks_of(requests[rid])[: c // kv.block_size + 1]
                decode_block_reads += len(read)
                decode_blocks.update(read)
        else:
            s.prefill_pairs += n * c + n * (n + 1) // 2
            s.prefill_ctx += c + n
            s.prefill_seqs += 1
        if c + n - len(out.spec_token_ids.get(rid, ())) == requests[rid].num_tokens:  # drafts are not known tokens
            s.samples += 1
            if sampled is not None:
                sampled.append(rid)
    # a block read by several decodes is a full prefix block (only full blocks are shared)
    s.decode_ctx_distinct = s.decode_ctx - (decode_block_reads - len(decode_blocks)) * kv.block_size
    s.lora_groups = len(adapters)
    return s
