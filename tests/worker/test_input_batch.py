"""SchedulerOutput -> packed tensors, and the worker's request state across steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchserve.config import ConfigError
from batchserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from batchserve.sampling_params import SamplingParams
from batchserve.worker.device import resolve_device, resolve_dtype
from batchserve.worker.input_batch import RequestTable

P = SamplingParams()


def test_packing_a_mixed_batch():
    states = RequestTable(8)
    step = SchedulerOutput(
        new_requests=[
            NewRequestData("new", [10, 11, 12, 13, 14], 5, P, [7], 0),  # first chunk of a prompt
            NewRequestData("hit", list(range(20, 30)), 10, P, [2, 5], 8),  # prefix-cache hit: 8 tokens cached
        ],
        num_scheduled_tokens={"new": 3, "hit": 2},
    )
    states.apply(step)
    batch = states.build(step, torch.device("cpu"))
    assert batch.input_ids.tolist() == [10, 11, 12, 28, 29]
    assert batch.positions.tolist() == [0, 1, 2, 8, 9]
    assert batch.attn_metadata.slot_mapping.tolist() == [56, 57, 58, 40, 41]
    assert batch.attn_metadata.block_tables.tolist() == [[7, 0], [2, 5]]
    assert batch.attn_metadata.seq_lens.tolist() == [3, 10]
    assert batch.attn_metadata.query_start_loc.tolist() == [0, 3, 5]
    assert batch.attn_metadata.max_query_len == 3 and batch.attn_metadata.max_seq_len == 10
    assert batch.attn_metadata.query_pad_index.tolist() == [0, 1, 2, 3, 4]
    # only "hit" has computed all its known tokens
    assert batch.sample_req_ids == ["hit"] and batch.logits_indices.tolist() == [4]

    # next step: "new" finishes its prompt and "hit" decodes its sampled token
    states.append_sampled(np.array([states.row_of["hit"]]), [99])
    step = SchedulerOutput(
        cached_requests=[CachedRequestData("new", [], 3), CachedRequestData("hit", [], 10)],
        num_scheduled_tokens={"new": 2, "hit": 1},
    )
    states.apply(step)
    batch = states.build(step, torch.device("cpu"))
    assert batch.req_ids == ["hit", "new"]  # decodes packed first: each attention path takes a contiguous range
    assert batch.input_ids.tolist() == [99, 13, 14]
    assert batch.positions.tolist() == [10, 3, 4]
    assert batch.attn_metadata.slot_mapping.tolist() == [42, 59, 60]
    assert batch.sample_req_ids == ["hit", "new"] and batch.logits_indices.tolist() == [0, 2]
    assert batch.attn_metadata.query_pad_index.tolist() == [0, 2, 3]
    decode, prefill = batch.attn_metadata.decode, batch.attn_metadata.prefill
    assert decode.token_range == (0, 1) and prefill.token_range == (1, 3)


def test_padding_rows_write_the_scratch_slot_and_are_not_sampled():
    states = RequestTable(4, scratch_slot=400)
    states.apply(
        SchedulerOutput(
            new_requests=[
                NewRequestData("done", [1, 2, 3, 4, 5, 6], 4, P, [3, 9], 5),
                NewRequestData("live", [7, 8, 9], 2, P, [6], 2),
            ]
        )
    )
    step = SchedulerOutput(
        cached_requests=[CachedRequestData("done", [], 4), CachedRequestData("live", [], 2)],
        num_scheduled_tokens={"done": 1, "live": 1},
        padding_req_ids={"done"},
    )
    states.apply(step)
    batch = states.build(step, torch.device("cpu"))
    assert batch.req_ids == ["done", "live"]
    assert batch.positions.tolist() == [4, 2] and batch.input_ids.tolist() == [5, 9]
    assert batch.attn_metadata.slot_mapping.tolist() == [400, 6 * 4 + 2]  # padding -> scratch, live -> its block
    assert batch.attn_metadata.seq_lens.tolist() == [5, 3]  # padding still attends over its context
    assert batch.sample_req_ids == ["live"]
    states.scratch_slot = None
    with pytest.raises(ValueError, match="scratch"):
        states.build(step, torch.device("cpu"))


def test_state_follows_new_cached_and_finished():
    states = RequestTable(8)
    states.apply(SchedulerOutput(new_requests=[NewRequestData("a", [1, 2], 2, P, [0], 0)]))
    states.apply(SchedulerOutput(cached_requests=[CachedRequestData("a", [3, 4], 2)]))
    row = states.row_of["a"]
    assert states.block_table[row, :3].tolist() == [0, 3, 4] and states.num_blocks[row] == 3
    assert states.num_computed[row] == 2 and list(states.tokens(row)) == [1, 2]
    states.apply(SchedulerOutput(finished_req_ids={"a", "unknown"}))
    assert len(states) == 0


def test_rows_and_token_capacity_grow():
    states = RequestTable(4, rows=2, max_tokens=4)
    step = SchedulerOutput(
        new_requests=[
            NewRequestData(f"r{i}", list(range(1, 10)), 9, P, [i * 3, i * 3 + 1, i * 3 + 2], 0) for i in range(5)
        ],
        num_scheduled_tokens={f"r{i}": 9 for i in range(5)},
    )
    states.apply(step)
    batch = states.build(step, torch.device("cpu"))
    assert batch.input_ids.tolist() == list(range(1, 10)) * 5
    assert batch.attn_metadata.slot_mapping.tolist()[9:18] == [12, 13, 14, 15, 16, 17, 18, 19, 20]
    states.append_sampled(batch.sample_rows, [50, 51, 52, 53, 54])
    assert list(states.tokens(states.row_of["r4"]))[-2:] == [9, 54]


def test_too_few_blocks_is_an_error():
    states = RequestTable(8)
    step = SchedulerOutput(
        new_requests=[NewRequestData("a", list(range(9)), 9, P, [0], 0)], num_scheduled_tokens={"a": 9}
    )
    states.apply(step)
    with pytest.raises(ValueError, match="blocks"):
        states.build(step, torch.device("cpu"))


def test_device_and_dtype_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    with pytest.raises(ConfigError):
        resolve_dtype("int8")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):
            resolve_device("cuda")
