"""execute(SchedulerOutput) -> ModelOutput: swaps, one packed forward pass, logits at the sampled rows, sampling."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from batchserve.config import EngineConfig, ModelConfig
from batchserve.core.outputs import ModelOutput, RunnerTimings, SchedulerOutput
from batchserve.core.speculative import speculates
from batchserve.worker.cuda_graphs import decode_graphs_for
from batchserve.worker.input_batch import InputBatch, RequestTable
from batchserve.worker.kv_cache import (
    GiB,
    KVCache,
    block_bytes,
    num_blocks_for_budget,
    num_swap_blocks_for_budget,
    pool_dtype,
)
from batchserve.worker.kv_offload import BlockWriter, load_blocks
from batchserve.worker.prompt_logprobs import PromptLogprobs
from batchserve.worker.sampler import Sampler, SamplingMetadata
from batchserve.worker.speculative import draft_hidden_rows, stage_drafts, unstage_drafts, verify
from batchserve.worker.structured_output import StructuredOutputs

if TYPE_CHECKING:
    from batchserve.layers.parallel import PipelineStage
    from batchserve.modes import ModeDecision
    from batchserve.worker.draft_model import DraftModelProposer
    from batchserve.worker.lora_slots import LoRAPool
    from batchserve.worker.pooler import Pooler

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        engine_config: EngineConfig,
        model_config: ModelConfig,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        initial_kv_blocks: int | None = None,
    ):
        """The KV pool: the whole budget (num_kv_blocks, else the memory fraction) unless `initial_kv_blocks` is
        given; then only that many blocks now, and resize_kv_cache() grows the pool up to the budget later."""
        self.engine_config = engine_config
        self.model_config = model_config
        self.model = model
        self.device = device
        self.dtype = dtype
        cache = engine_config.cache
        self.block_size = cache.block_size
        swap_enabled = engine_config.scheduler.preemption_mode == "swap"
        self.kv_dtype = pool_dtype(cache, dtype)  # the pool's element type (kv_cache_dtype)
        self.max_kv_blocks = num_blocks_for_budget(cache, model_config, self.kv_dtype, device)
        self.num_kv_blocks = self.max_kv_blocks
        if initial_kv_blocks is not None:
            self.num_kv_blocks = max(1, min(initial_kv_blocks, self.max_kv_blocks))
        self.num_swap_blocks = num_swap_blocks_for_budget(cache, model_config, self.kv_dtype, enabled=swap_enabled)
        # one block past the pool's: the scratch slot where static batching's padding rows write their K/V
        self.kv_cache = KVCache.allocate(
            model_config, self.num_kv_blocks + 1, self.num_swap_blocks, self.block_size, self.kv_dtype, device
        )
        self.sampler = Sampler()
        # grammar matchers of constrained sequences; startup gives it the tokenizer its compiler needs
        self.structured_outputs = StructuredOutputs(model_config.vocab_size, model_config.eos_token_ids)
        self.prompt_logprobs = PromptLogprobs()  # scores of prompt tokens, for the requests that ask
        self.requests = RequestTable(
            self.block_size,
            scratch_slot=self.num_kv_blocks * self.block_size,
            deterministic=engine_config.deterministic,
            long_context_from=model_config.long_context_from,
        )
        self.last_timings = RunnerTimings()
        self._log_pool()
        self.decode_graphs = decode_graphs_for(self)  # None off CUDA and with enforce_eager
        self.draft: DraftModelProposer | None = None  # speculative method draft_model (engine/startup.py)
        self.modes: ModeDecision | None = None  # the mode table's decision, made before loading (engine/startup.py)
        self.pooler: Pooler | None = None  # a pooling runner's (engine/startup.py, worker/pooler.py)
        self.offload: BlockWriter | None = None  # the disk tier's writer (worker/kv_offload.py), when it is on
        self.lora: LoRAPool | None = None  # enable_lora: the adapters and their device slots (engine/startup.py)
        self.pipeline: PipelineStage | None = None  # this rank's pipeline stage (worker/rank_worker.py); None: whole

    def resize_kv_cache(self, num_blocks: int, keep_block_ids: Sequence[int]) -> None:
        """Grow the device pool to num_blocks (at most max_kv_blocks), between steps. keep_block_ids: the blocks
        whose K/V stay (held by a request or cached for a prefix), at the same ids; the rest start anew (the old
        scratch block's padding K/V is never kept)."""
        if not self.num_kv_blocks <= num_blocks <= self.max_kv_blocks:
            raise ValueError(
                f"a KV pool of {num_blocks} blocks: it holds {self.num_kv_blocks}, may hold {self.max_kv_blocks}"
            )
        if self.offload is not None:
            self.offload.flush()  # the tier's writer reads blocks from the pool: none while it moves
        self.kv_cache.resize(num_blocks + 1, keep_block_ids)
        self.num_kv_blocks = num_blocks
        self.requests.scratch_slot = num_blocks * self.block_size
        if self.decode_graphs is not None:
            self.decode_graphs.capture_all()  # the graphs hold the old pool's addresses
        self._log_pool()

    def _log_pool(self) -> None:
        per_block = block_bytes(self.model_config, self.block_size, self.kv_dtype)
        budget = "" if self.num_kv_blocks == self.max_kv_blocks else f", may grow to {self.max_kv_blocks} blocks"
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s%s)",
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * self.block_size,
            self.num_kv_blocks * per_block / GiB,
            self.device,
            budget,
        )

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv_cache.device_caches

    def close(self) -> None:
        """Stop what runs beside the steps (the grammar masks' worker thread); the tensors go with the runner."""
        self.structured_outputs.close()
        if self.offload is not None:
            self.offload.close()

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        output = self._execute(scheduler_output)
        if self.pooler is not None:
            output.pooled = self.pooler.take_outputs()
        if scheduler_output.kv_saves and self.offload is not None:  # blocks this step filled: the tier may write them
            self.offload.save(scheduler_output.kv_saves)
        if self.draft is not None and scheduler_output.num_draft_tokens > 0 and output.req_ids:
            start = time.perf_counter()
            output.draft_token_ids = self._propose_drafts(output.req_ids, scheduler_output.num_draft_tokens)
            self.last_timings.forward_s += time.perf_counter() - start  # the draft model's passes are forward time
        return output

    def _propose_drafts(self, req_ids: list[str], k: int) -> dict[str, list[int]]:
        """The draft model's next k tokens for each sampled sequence that may speculate."""
        table = self.requests
        rows = {req_id: table.row_of[req_id] for req_id in req_ids}
        sequences = {req_id: table.tokens(row)[:] for req_id, row in rows.items() if speculates(table.params[row])}
        return self.draft.propose(sequences, k) if sequences else {}

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        timings = self.last_timings = RunnerTimings()
        start = time.perf_counter()
        self.kv_cache.swap_out(scheduler_output.blocks_to_swap_out)
        self.kv_cache.swap_in(scheduler_output.blocks_to_swap_in)
        load_blocks(self.kv_cache, scheduler_output.kv_loads)  # blocks read back from the disk tier
        self.requests.apply(scheduler_output)
        if self.lora is not None:
            self.lora.follow(scheduler_output)
        self._track_constraints(scheduler_output)
        self.prompt_logprobs.follow(scheduler_output.new_requests, scheduler_output.finished_req_ids)
        if self.pooler is not None:
            self.pooler.follow(scheduler_output)
        if scheduler_output.is_empty:
            timings.prepare_s = time.perf_counter() - start
            return ModelOutput()
        drafts = scheduler_output.spec_token_ids
        stage_drafts(self.requests, drafts)  # query tokens of this step, not known tokens: unstaged once built
        batch = self.requests.build(scheduler_output, self.device)
        unstage_drafts(self.requests, drafts)
        batch.attn_metadata.prefill_attention = str(self.engine_config.prefill_attention)  # the engine option
        if self.lora is not None:
            batch.attn_metadata.lora = self.lora.step(batch.req_ids, batch.query_lens)
        # the grammar masks of the rows _sample takes (drafted rows are verified instead), filled during the forward
        self.structured_outputs.start_fill([r for r in batch.sample_req_ids if r not in drafts])
        prepared = time.perf_counter()
        timings.prepare_s = prepared - start
        graphs = self.decode_graphs is not None and not batch.attn_metadata.lora  # graphs hold no adapter
        if graphs and self.decode_graphs.takes(batch.attn_metadata):
            hidden = self.decode_graphs.run(batch.input_ids, batch.attn_metadata)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata)
        if self.pipeline is not None and not self.pipeline.is_last:  # the activations went on to the next stage
            return self._last_stage_output(batch, prepared)
        output = self._logits_and_sample(batch, hidden, drafts, prepared)
        if self.pipeline is not None:  # the other stages' request tables take the same tokens
            self.pipeline.broadcast_from_last(output)
        return output

    def _last_stage_output(self, batch: InputBatch, prepared: float) -> ModelOutput:
        """A pipeline stage before the last: the step's output as the last stage sampled it, its tokens appended
        here as they were there."""
        self.requests.advance(batch)
        output = self.pipeline.broadcast_from_last(None)
        if output.req_ids:
            self.requests.append_sampled(batch.sample_rows, output.sampled_token_ids)
            self.structured_outputs.accept(output.req_ids, output.sampled_token_ids)
        self.last_timings.forward_s = time.perf_counter() - prepared
        return output

    def _logits_and_sample(self, batch: InputBatch, hidden: torch.Tensor, drafts, prepared: float) -> ModelOutput:
        timings = self.last_timings
        scoring = self.prompt_logprobs.plan(self.requests, batch, self.device)  # before the table advances
        if self.pooler is not None:  # pooling requests' rows pooled; only generation requests left to sample
            batch = self.pooler.pool(batch, hidden, self.requests)
        self.requests.advance(batch)
        if scoring is not None:  # every scored prompt position of the step in one lm_head call
            self.prompt_logprobs.score(self.model.compute_logits(hidden.index_select(0, scoring.packed_rows)), scoring)
        if not batch.sample_req_ids:
            timings.forward_s = time.perf_counter() - prepared
            return ModelOutput()
        if drafts:
            output = self._sample_speculative(batch, hidden, drafts)
            timings.forward_s = time.perf_counter() - prepared
            return output
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices)).float()
        forwarded = time.perf_counter()
        timings.forward_s = forwarded - prepared
        output = self._sample(batch, logits)
        timings.sample_s = time.perf_counter() - forwarded
        return output

    def _track_constraints(self, scheduler_output: SchedulerOutput) -> None:
        """Matchers follow the request table: dropped with it, (re)built with a new or recomputed request."""
        self.structured_outputs.remove(scheduler_output.finished_req_ids)
        for new in scheduler_output.new_requests:
            constraint = new.sampling_params.structured_outputs
            if constraint is not None:
                self.structured_outputs.add(new.req_id, constraint, new.token_ids[new.num_prompt_tokens :])

    def _sample(self, batch: InputBatch, logits: torch.Tensor) -> ModelOutput:
        table, rows = self.requests, batch.sample_rows.tolist()
        meta = SamplingMetadata.build(
            params=[table.params[r] for r in rows],
            token_ids=[table.tokens(r) for r in rows],
            num_prompt_tokens=table.num_prompt[batch.sample_rows].tolist(),
            eos_token_ids=self.model_config.eos_token_ids,
            vocab_size=logits.shape[-1],
            device=self.device,
            token_bitmask=self.structured_outputs.masks(batch.sample_req_ids),
        )
        out = self.sampler(logits, meta)
        sampled = out.token_ids.tolist()  # the step's one device -> host transfer
        table.append_sampled(batch.sample_rows, sampled)
        self.structured_outputs.accept(batch.sample_req_ids, sampled)
        return ModelOutput(
            req_ids=list(batch.sample_req_ids),
            sampled_token_ids=sampled,
            logprobs=out.logprobs,
            prompt_logprobs=self.prompt_logprobs.take(batch.sample_req_ids),
        )

    def _sample_speculative(self, batch: InputBatch, hidden: torch.Tensor, drafts: dict[str, list[int]]) -> ModelOutput:
        """Plain sampling for the requests without drafts; verification (worker/speculative.py) for the others, whose
        rejected positions leave the table: computed count and blocks, as the scheduler rolls them back."""
        keep = [i for i, req_id in enumerate(batch.sample_req_ids) if req_id not in drafts]
        output = ModelOutput()
        if keep:
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            plain = dataclasses.replace(
                batch,
                sample_req_ids=[batch.sample_req_ids[i] for i in keep],
                sample_rows=batch.sample_rows[keep],
                logits_indices=batch.logits_indices.index_select(0, index),
            )
            output = self._sample(
                plain, self.model.compute_logits(hidden.index_select(0, plain.logits_indices)).float()
            )
        spec_ids, spec_rows = draft_hidden_rows(batch, drafts)
        rows = torch.tensor(spec_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
        verified = verify(logits, self.requests, spec_ids, drafts, self.model_config.eos_token_ids)
        table = self.requests
        for req_id in spec_ids:
            row, accepted = table.row_of[req_id], verified.accepted[req_id]
            for token in accepted + [verified.next_token[req_id]]:
                table.append_sampled(np.array([row]), [token])
            table.num_computed[row] -= len(drafts[req_id]) - len(accepted)
            table.num_blocks[row] = min(int(table.num_blocks[row]), -(-int(table.num_computed[row]) // self.block_size))
        output.req_ids += spec_ids
        output.sampled_token_ids += [verified.next_token[r] for r in spec_ids]
        output.accepted_token_ids = verified.accepted
        if output.logprobs is not None:
            output.logprobs += [None] * len(spec_ids)
        return output
