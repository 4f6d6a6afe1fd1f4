"""execute(SchedulerOutput) -> ModelOutput: swaps, one packed forward pass, logits at the sampled rows, sampling."""

from __future__ import annotations

import time

import torch
from torch import nn

from batchserve.config import EngineConfig, ModelConfig
from batchserve.core.outputs import ModelOutput, RunnerTimings, SchedulerOutput
from batchserve.worker.input_batch import InputBatch, RequestTable
from batchserve.worker.kv_cache import KVCache, num_blocks_for_budget, num_swap_blocks_for_budget
from batchserve.worker.sampler import Sampler, SamplingMetadata


class ModelRunner:
    def __init__(
        self,
        engine_config: EngineConfig,
        model_config: ModelConfig,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.engine_config = engine_config
        self.model_config = model_config
        self.model = model
        self.device = device
        self.dtype = dtype
        cache = engine_config.cache
        self.block_size = cache.block_size
        swap_enabled = engine_config.scheduler.preemption_mode == "swap"
        self.num_kv_blocks = num_blocks_for_budget(cache, model_config, dtype, device)
        self.num_swap_blocks = num_swap_blocks_for_budget(cache, model_config, dtype, enabled=swap_enabled)
        # one block past the pool's: the scratch slot where static batching's padding rows write their K/V
        self.kv_cache = KVCache.allocate(
            model_config, self.num_kv_blocks + 1, self.num_swap_blocks, self.block_size, dtype, device
        )
        self.sampler = Sampler()
        self.requests = RequestTable(self.block_size, scratch_slot=self.num_kv_blocks * self.block_size)
        self.last_timings = RunnerTimings()

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv_cache.device_caches

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        timings = self.last_timings = RunnerTimings()
        start = time.perf_counter()
        self.kv_cache.swap_out(scheduler_output.blocks_to_swap_out)
        self.kv_cache.swap_in(scheduler_output.blocks_to_swap_in)
        self.requests.apply(scheduler_output)
        if scheduler_output.is_empty:
            timings.prepare_s = time.perf_counter() - start
            return ModelOutput()
        batch = self.requests.build(scheduler_output, self.device)
        prepared = time.perf_counter()
        timings.prepare_s = prepared - start
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata)
        self.requests.advance(batch)
        if not batch.sample_req_ids:
            timings.forward_s = time.perf_counter() - prepared
            return ModelOutput()
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices)).float()
        forwarded = time.perf_counter()
        timings.forward_s = forwarded - prepared
        output = self._sample(batch, logits)
        timings.sample_s = time.perf_counter() - forwarded
        return output

    def _sample(self, batch: InputBatch, logits: torch.Tensor) -> ModelOutput:
        table, rows = self.requests, batch.sample_rows.tolist()
        meta = SamplingMetadata.build(
            params=[table.params[r] for r in rows],
            token_ids=[table.tokens(r) for r in rows],
            num_prompt_tokens=table.num_prompt[batch.sample_rows].tolist(),
            eos_token_ids=self.model_config.eos_token_ids,
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, meta)
        sampled = out.token_ids.tolist()  # the step's one device -> host transfer
        table.append_sampled(batch.sample_rows, sampled)
        return ModelOutput(req_ids=list(batch.sample_req_ids), sampled_token_ids=sampled, logprobs=out.logprobs)
