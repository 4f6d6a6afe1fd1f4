"""A pipeline stage of a model: its layers only, the activations received from the stage before and sent to the one
after (layers/parallel.py PipelineStage). The first stage embeds the tokens, the last normalises and projects onto
the vocabulary; the runner samples on the last stage and the others take its tokens (worker/model_runner.py).

The stage runs the model's own Python layers in the model's order (the sequencing of models/llama.py forward without
the native decoder loop, which runs all layers in one call): no operator is written here.

Micro-batches: a step's batch is cut into up to `stage.micro_batches` runs of sequences (micro_batches below), each
with the attention metadata of its own rows. A stage runs them in order and hands each on as soon as it is computed,
without waiting for the next stage to take it, so stage s computes micro-batch m + 1 while stage s + 1 computes m.
The decode rows are split; the prefill chunks of the step (fewer rows, more tokens each) ride with the last
micro-batch, so a chunked prefill shares a step with decodes as without micro-batches. Every row attends to its own
sequence only, so a micro-batch computes what its rows would in the whole batch; the last stage joins them back in
the batch's order before the norm and the logits.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from batchserve.layers.attention import AttentionMetadata, KVCache, SeqGroup
from batchserve.layers.parallel import PipelineStage


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    rows: slice  # its tokens: these rows of the step's packed batch
    metadata: AttentionMetadata  # attention over those rows only


def micro_batches(metadata: AttentionMetadata, count: int) -> list[MicroBatch]:
    """The step cut into up to `count` micro-batches: the decode rows (one token each, packed first) in runs as even
    as the count allows, the prefill chunks with the last run. One micro-batch, the whole step, where there are no
    decode rows or no more than one, or the step has adapters (refused with ranks anyway)."""
    decode, total = metadata.decode, metadata.slot_mapping.shape[0]
    rows = 0 if decode is None or decode.max_query_len != 1 else decode.token_range[1]  # sequence i at row i
    pieces = min(count, rows)
    if pieces <= 1 or metadata.lora is not None:
        return [MicroBatch(slice(0, total), metadata)]
    bounds = [rows * i // pieces for i in range(pieces + 1)]
    return [_micro_batch(metadata, bounds[i], bounds[i + 1], total, i == pieces - 1) for i in range(pieces)]


def _micro_batch(meta: AttentionMetadata, start: int, stop: int, total: int, last: bool) -> MicroBatch:
    """Decode rows start..stop-1 (and, the last, every row after them: the prefill chunks), their metadata rebased
    to row 0. The whole-batch padded layout (query_pad_index) is not rebuilt: the layers read the groups' own."""
    decode = meta.decode
    end, seqs = (total, slice(start, None)) if last else (stop, slice(start, stop))
    group = SeqGroup(
        token_range=(0, stop - start),
        block_tables=decode.block_tables[start:stop],
        seq_lens=decode.seq_lens[start:stop],
        positions=decode.positions[start:stop],
        max_query_len=1,
    )
    prefill = meta.prefill if last else None
    if prefill is not None:
        first, after = prefill.token_range
        prefill = dataclasses.replace(prefill, token_range=(first - start, after - start))
    metadata = AttentionMetadata(
        slot_mapping=meta.slot_mapping[start:end],
        positions=meta.positions[start:end],
        block_tables=meta.block_tables[seqs],
        seq_lens=meta.seq_lens[seqs],
        query_start_loc=meta.query_start_loc[start:] - start
        if last
        else meta.query_start_loc[start : stop + 1] - start,
        max_query_len=meta.max_query_len if prefill is not None else 1,
        max_seq_len=meta.max_seq_len,
        decode=group,
        prefill=prefill,
        long_context=None if meta.long_context is None else meta.long_context[start:end],
        prefill_attention=meta.prefill_attention,
    )
    return MicroBatch(slice(start, end), metadata)


class NotOnThisStage(nn.Module):
    """The output projection of a stage that is not the last: never called."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the logits are computed on the last pipeline stage only")


class StageModel(nn.Module):
    """The runner's model on one pipeline stage: forward returns the final hidden states on the last stage, None on
    the others (their activations went on to the next stage)."""

    def __init__(self, model: nn.Module, stage: PipelineStage):
        super().__init__()
        self.model = model
        self.stage = stage
        self.decoder_loop = None

    @property
    def config(self):
        return self.model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        model, stage = self.model, self.stage
        stage.timeline = []
        outputs = []
        for index, batch in enumerate(micro_batches(attn_metadata, stage.micro_batches)):
            rows = batch.rows
            if stage.is_first:
                start = time.monotonic()
                x, residual = model.embed(input_ids[rows]), None
            else:
                shape = (rows.stop - rows.start, model.config.hidden_size)
                x, residual = stage.receive_activations(shape, model.norm.weight.dtype, 2, micro_batch=index)
                start = time.monotonic()
            x, residual = self._layers(x, residual, positions[rows], kv_caches, batch.metadata)
            stage.timeline.append((start, time.monotonic()))
            if stage.is_last:
                outputs.append((x, residual))
            else:
                stage.send_activations(x, residual, micro_batch=index)
        if not stage.is_last:
            stage.finish_sends()
            return None
        if len(outputs) > 1:
            outputs = [tuple(torch.cat(parts) for parts in zip(*outputs, strict=True))]
        return model.norm(*outputs[0])[0]

    def _layers(self, x, residual, positions, kv_caches: list[KVCache], attn_metadata: AttentionMetadata):
        model = self.model
        tables = model.rope_tables(positions, x.dtype, attn_metadata)
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            cos, sin = tables[layer.self_attn.rope_table]
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
        return x, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
