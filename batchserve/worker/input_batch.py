"""SchedulerOutput -> the packed tensors of one forward pass, plus the worker's per-request state across steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchserve.core.outputs import SchedulerOutput
from batchserve.sampling_params import SamplingParams
from batchserve.worker.attention import AttentionMetadata


@dataclass
class RequestState:
    """What the worker remembers about a request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far (the worker appends its own samples)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [T] int64, packed over the batch
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: rows of the hidden states to sample (last token of each sampled seq)
    req_ids: list[str]  # batch order
    sample_req_ids: list[str]  # the requests sampled this step, in batch order (parallel to logits_indices)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def update_states(states: dict[str, RequestState], scheduler_output: SchedulerOutput) -> None:
    """Apply one step's request changes: forget finished/preempted, add new, extend cached."""
    for req_id in scheduler_output.finished_req_ids:
        states.pop(req_id, None)
    for new in scheduler_output.new_requests:
        states[new.req_id] = RequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
        )
    for cached in scheduler_output.cached_requests:
        state = states[cached.req_id]
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens


def build_input_batch(
    scheduler_output: SchedulerOutput,
    states: dict[str, RequestState],
    block_size: int,
    device: torch.device,
) -> InputBatch:
    """Pack the scheduled tokens of every request (in batch order) into flat tensors, with one host->device copy."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    num_seqs = len(req_ids)
    query_lens = np.fromiter((scheduler_output.num_scheduled_tokens[r] for r in req_ids), np.int64, num_seqs)
    starts = np.fromiter((states[r].num_computed_tokens for r in req_ids), np.int64, num_seqs)
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    max_query_len = int(query_lens.max())
    max_seq_len = int(seq_lens.max())
    max_blocks = -(-max_seq_len // block_size)
    num_tokens = int(query_start_loc[-1])

    input_ids = np.empty(num_tokens, np.int64)
    positions = np.empty(num_tokens, np.int64)
    slot_mapping = np.empty(num_tokens, np.int64)
    block_tables = np.zeros((num_seqs, max_blocks), np.int64)
    sample_req_ids, logits_indices = [], []
    for i, req_id in enumerate(req_ids):
        state = states[req_id]
        start, end = int(starts[i]), int(seq_lens[i])
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if end > len(state.token_ids):
            raise ValueError(
                f"request {req_id}: {end - start} tokens scheduled from {start}, only {len(state.token_ids)} known"
            )
        num_blocks = -(-end // block_size)
        if num_blocks > len(state.block_ids):
            raise ValueError(f"request {req_id}: {end} tokens need {num_blocks} blocks, has {len(state.block_ids)}")
        table = np.asarray(state.block_ids[:num_blocks], np.int64)
        block_tables[i, :num_blocks] = table
        pos = np.arange(start, end, dtype=np.int64)
        positions[lo:hi] = pos
        input_ids[lo:hi] = state.token_ids[start:end]
        slot_mapping[lo:hi] = table[pos // block_size] * block_size + pos % block_size
        if end == len(state.token_ids):
            sample_req_ids.append(req_id)
            logits_indices.append(hi - 1)

    # The padded [B, max_query_len] layout used by the general attention path.
    seq_index = np.repeat(np.arange(num_seqs, dtype=np.int64), query_lens)
    query_pad_index = seq_index * max_query_len + (np.arange(num_tokens, dtype=np.int64) - query_start_loc[seq_index])

    parts = [
        input_ids,
        positions,
        slot_mapping,
        query_pad_index,
        seq_lens,
        query_start_loc,
        np.asarray(logits_indices, np.int64),
        block_tables.reshape(-1),
    ]
    # One small host -> device copy for the whole step (pinning it would cost more than the copy).
    flat = torch.from_numpy(np.concatenate(parts)).to(device)
    (t_ids, t_pos, t_slots, t_pad, t_seq_lens, t_qsl, t_logits, t_tables) = torch.split(flat, [len(p) for p in parts])
    metadata = AttentionMetadata(
        slot_mapping=t_slots,
        positions=t_pos,
        block_tables=t_tables.view(num_seqs, max_blocks),
        seq_lens=t_seq_lens,
        query_start_loc=t_qsl,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_pad_index=t_pad,
    )
    return InputBatch(
        input_ids=t_ids,
        positions=t_pos,
        attn_metadata=metadata,
        logits_indices=t_logits,
        req_ids=req_ids,
        sample_req_ids=sample_req_ids,
    )
