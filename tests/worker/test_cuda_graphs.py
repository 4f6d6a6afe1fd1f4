"""CUDA graphs for decode steps (worker/cuda_graphs.py) without a GPU: the ladder of captured sizes, padding a batch
up to the next size, the static buffers, and which steps may replay. The capture is a recording one whose replay
runs the forward again on the static buffers (what a graph replay computes); the model is a tiny real Llama."""

from __future__ import annotations

import pytest
import torch

from batchserve.config import CacheConfig, EngineConfig
from batchserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from batchserve.models.loader import load_model, load_model_config
from batchserve.sampling_params import SamplingParams
from batchserve.worker.cuda_graphs import DecodeGraphs, capture_sizes, decode_graphs_for, padded_size
from batchserve.worker.model_runner import ModelRunner
from tests.tiny_models import VOCAB, build_hf_model

BLOCK_SIZE = 4


class RecordingCapture:
    """Stands in for torch.cuda.graph: records what was captured, replays by calling the forward again."""

    def __init__(self) -> None:
        self.captured: list[int] = []

    def __call__(self, fn):
        self.captured.append(fn().shape[0])  # a capture runs the forward once, on the static buffers
        return fn


def assert_only_slots_changed(before: torch.Tensor, after: torch.Tensor, slots: set[int]) -> set[int]:
    """Pool tensors [num_blocks, block_size, ...] differ only at `slots` (block * block_size + offset) -> those that
    changed."""
    changed = set((before != after).flatten(2).any(-1).view(-1).nonzero().flatten().tolist())
    assert changed <= slots, (changed, slots)
    return changed


def test_ladder_of_sizes():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]  # the top rounds up: a full batch has a graph
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padding_to_the_next_size():
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 63, 64)] == [1, 2, 4, 4, 8, 8, 16, 64, 64]
    assert padded_size(65, sizes) is None  # above the ladder: eager


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    build_hf_model("llama", directory)
    model_config = load_model_config(directory)
    model = load_model(directory, model_config, torch.float32, torch.device("cpu"))
    config = EngineConfig(
        model=str(directory), device="cpu", cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=64)
    )
    return ModelRunner(config, model_config, model, torch.device("cpu"), torch.float32)


def graphs_for(runner: ModelRunner, sizes: list[int], max_blocks: int = 8) -> tuple[DecodeGraphs, RecordingCapture]:
    capture = RecordingCapture()
    graphs = DecodeGraphs(
        forward=runner.model,
        kv_caches=lambda: runner.kv_caches,
        sizes=sizes,
        max_blocks=max_blocks,
        scratch_slot=lambda: runner.requests.scratch_slot,
        device=runner.device,
        capture=capture,
    )
    return graphs, capture


def prefill_then_decode(runner: ModelRunner, prompt_lens: list[int], tag: str, first_block: int):
    """Prefill len(prompt_lens) requests through the runner, then build (not run) their first decode step's batch."""
    block = first_block
    new, blocks = [], {}
    for i, n in enumerate(prompt_lens):
        count = -(-(n + 1) // BLOCK_SIZE)
        blocks[f"{tag}{i}"] = list(range(block, block + count))[::-1]  # not in order
        block += count
        prompt = [(7 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(n)]
        new.append(NewRequestData(f"{tag}{i}", prompt, n, SamplingParams(temperature=0.0), blocks[f"{tag}{i}"], 0))
    runner.execute(SchedulerOutput(new_requests=new, num_scheduled_tokens={r.req_id: len(r.token_ids) for r in new}))
    decode = SchedulerOutput(
        cached_requests=[CachedRequestData(r.req_id, [], len(r.token_ids)) for r in new],
        num_scheduled_tokens={r.req_id: 1 for r in new},
    )
    runner.requests.apply(decode)
    return runner.requests.build(decode, runner.device)


def test_replay_of_padded_batch_equals_eager_and_touches_only_the_scratch_slot(runner):
    graphs, capture = graphs_for(runner, [1, 2, 4, 8])
    runner.kv_caches[0][0].normal_()  # a pool with contents: the capture must leave them be
    pool_before = [t.clone() for pair in runner.kv_caches for t in pair]
    report = graphs.capture_all()
    scratch = runner.requests.scratch_slot
    for before, after in zip(pool_before, [t for pair in runner.kv_caches for t in pair], strict=True):
        assert_only_slots_changed(before, after, {scratch})
    assert capture.captured == [8, 4, 2, 1] and report.sizes == [1, 2, 4, 8]  # largest first
    batch = prefill_then_decode(runner, [5, 9, 3], "a", first_block=0)  # 3 sequences: padded to 4
    assert graphs.takes(batch.attn_metadata)
    pool_before = [t.clone() for pair in runner.kv_caches for t in pair]
    replayed = graphs.run(batch.input_ids, batch.attn_metadata).clone()
    assert graphs.replays == {4: 1}
    pool_after = [t.clone() for pair in runner.kv_caches for t in pair]
    eager = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn_metadata)
    assert replayed.shape == eager.shape == (3, runner.model_config.hidden_size)
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    # the replay wrote this step's K/V at the real slots and the padding row's at the scratch slot, nothing else
    written = set(batch.attn_metadata.slot_mapping.tolist()) | {runner.requests.scratch_slot}
    for before, after in zip(pool_before, pool_after, strict=True):
        assert assert_only_slots_changed(before, after, written) & set(batch.attn_metadata.slot_mapping.tolist())


def test_steps_that_run_eagerly(runner):
    graphs, _ = graphs_for(runner, [1, 2], max_blocks=2)
    assert not graphs.takes(prefill_then_decode(runner, [2], "b", first_block=20).attn_metadata)  # not captured yet
    graphs.capture_all()
    assert graphs.takes(prefill_then_decode(runner, [2, 3], "c", first_block=22).attn_metadata)
    assert not graphs.takes(prefill_then_decode(runner, [2, 3, 4], "d", first_block=26).attn_metadata)  # > ladder
    assert not graphs.takes(prefill_then_decode(runner, [9], "e", first_block=32).attn_metadata)  # 3 blocks > 2
    mixed = SchedulerOutput(
        new_requests=[NewRequestData("f", [5, 6, 7], 3, SamplingParams(), [40], 0)],
        cached_requests=[CachedRequestData("c0", [], 2)],
        num_scheduled_tokens={"f": 3, "c0": 1},
    )
    runner.requests.apply(mixed)
    assert not graphs.takes(runner.requests.build(mixed, runner.device).attn_metadata)  # a prefill chunk in it


def test_a_reallocated_pool_needs_a_new_capture(runner):
    graphs, _ = graphs_for(runner, [1, 2, 4])
    graphs.capture_all()
    batch = prefill_then_decode(runner, [4], "g", first_block=44)
    assert graphs.takes(batch.attn_metadata)
    runner.resize_kv_cache(runner.num_kv_blocks, keep_block_ids=range(runner.num_kv_blocks))  # new tensors, same size
    assert not graphs.takes(batch.attn_metadata)
    graphs.capture_all()
    assert graphs.takes(batch.attn_metadata)


def test_no_graphs_off_cuda(runner):
    """The CPU runs every step eagerly: the runner built no graphs, and asking again builds none."""
    assert runner.decode_graphs is None
    assert decode_graphs_for(runner) is None
