"""Pipeline micro-batches (models/pipeline.py micro_batches, layers/parallel.py PipelineStage): the split of a step's
attention metadata (decode rows in even runs, the prefill chunks with the last, each rebased to row 0), and, end to
end at PP=2 on a small 8-layer Llama (one process a stage, one thread each), greedy float32 tokens equal to
transformers' with micro-batches and without, while the stages' timelines show the overlap: with micro-batches the
second stage starts the first micro-batch before the first stage has finished its last; without, the second stage
never starts before the first is done."""

from __future__ import annotations

import torch
import transformers

from batchserve.entrypoints.llm import LLM
from batchserve.layers.attention import AttentionMetadata, SeqGroup
from batchserve.models.pipeline import micro_batches
from batchserve.sampling_params import SamplingParams
from tests.tiny_models import COMMON, hf_greedy, save_word_tokenizer

PROMPTS = [[5, 9, 17, 33, 40, 41, 7, 12, 60, 3, 44], [8, 70], [23, 24, 25, 26, 27, 28], [11, 12], [90, 3, 4],
           [1, 2, 3], [61, 62], [70, 71, 72, 73]]  # fmt: skip
MAX_TOKENS = 12
OPTIONS = dict(dtype="float32", num_threads=1, max_num_tokens=16, block_size=8, num_kv_blocks=64)


def _metadata(decodes: int, prefill_lens: list[int]) -> AttentionMetadata:
    """`decodes` one-token rows, then prefill chunks of `prefill_lens` tokens; row r writes slot 100 + r."""
    total = decodes + sum(prefill_lens)
    seq_lens = torch.tensor([10 + i for i in range(decodes)] + [n + 3 for n in prefill_lens])
    tables = torch.arange(len(seq_lens) * 4).view(-1, 4)
    decode = SeqGroup((0, decodes), tables[:decodes], seq_lens[:decodes], torch.arange(decodes) + 9, 1)
    starts = torch.tensor([0, *torch.tensor(prefill_lens).cumsum(0).tolist()])
    prefill = SeqGroup((decodes, total), tables[decodes:], seq_lens[decodes:], torch.arange(total - decodes),
                       max(prefill_lens), query_starts=starts)  # fmt: skip
    query_start_loc = torch.tensor([0, *torch.tensor([1] * decodes + prefill_lens).cumsum(0).tolist()])
    return AttentionMetadata(
        slot_mapping=torch.arange(total) + 100, positions=torch.arange(total), block_tables=tables,
        seq_lens=seq_lens, query_start_loc=query_start_loc, max_query_len=max(prefill_lens), max_seq_len=20,
        decode=decode, prefill=prefill,
    )  # fmt: skip


def test_decode_rows_split_evenly_and_prefill_chunks_ride_with_the_last():
    meta = _metadata(5, [4, 3])
    parts = micro_batches(meta, 2)
    assert [(p.rows.start, p.rows.stop) for p in parts] == [(0, 2), (2, 12)]
    first, last = parts[0].metadata, parts[1].metadata
    assert first.prefill is None and first.decode.token_range == (0, 2)
    assert first.slot_mapping.tolist() == [100, 101] and first.decode.seq_lens.tolist() == [10, 11]
    assert last.decode.token_range == (0, 3) and last.decode.seq_lens.tolist() == [12, 13, 14]
    assert last.prefill.token_range == (3, 10) and last.prefill is not meta.prefill
    assert last.slot_mapping.tolist() == list(range(102, 112))
    assert last.query_start_loc.tolist() == [0, 1, 2, 3, 7, 10] and last.seq_lens.shape[0] == 5
    assert meta.prefill.token_range == (5, 12)  # the step's own metadata untouched


def test_one_micro_batch_where_there_is_nothing_to_split():
    for meta, count in ((_metadata(1, [4]), 4), (_metadata(6, [2]), 1)):
        (whole,) = micro_batches(meta, count)
        assert whole.metadata is meta and (whole.rows.start, whole.rows.stop) == (0, meta.slot_mapping.shape[0])
    assert [p.rows.stop - p.rows.start for p in micro_batches(_metadata(3, [2]), 8)] == [1, 1, 3]  # one row a batch


def _eight_layers(directory):
    torch.manual_seed(8)
    # wide enough that a micro-batch's layers take a few milliseconds: longer than a stage takes to start its step
    config = transformers.LlamaConfig(
        **{**COMMON, "num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 512}
    )
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(directory)
    save_word_tokenizer(directory)
    return hf


def _run(directory, micro: int) -> tuple[list[list[int]], list[tuple[list, list]]]:
    """Every prompt greedily to MAX_TOKENS at PP=2 -> (tokens by prompt, each decode step's timelines: the first
    stage's (rank 0, here) and the last stage's)."""
    llm = LLM(str(directory), pipeline_parallel_size=2, pipeline_micro_batches=micro, **OPTIONS)
    engine, stage = llm.engine, llm.engine.runner.stage
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_prompt(None, {"prompt_token_ids": p}, greedy) for p in PROMPTS]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    timelines = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.delta_token_ids
        if len(stage.timeline) == micro:
            timelines.append((list(stage.timeline), list(stage.last_stage_timeline)))
    engine.close()
    return [tokens[i] for i in ids], timelines


def test_micro_batches_overlap_the_stages_and_keep_the_tokens(tmp_path):
    hf = _eight_layers(tmp_path)
    want = [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in PROMPTS]
    tokens, timelines = _run(tmp_path, micro=4)
    assert tokens == want
    assert len(timelines) >= MAX_TOKENS // 2  # the decode steps ran as four micro-batches on both stages
    assert all(len(last) == 4 for _, last in timelines)
    # stage 1 began micro-batch 0 while stage 0 was still computing its last (a loaded host may delay some steps)
    assert any(last[0][0] < first[-1][1] for first, last in timelines), timelines

    tokens, timelines = _run(tmp_path, micro=1)
    assert tokens == want
    assert timelines and all(last[0][0] >= first[0][1] for first, last in timelines)  # one stage at a time
