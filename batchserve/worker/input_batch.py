"""The worker's request state, kept in preallocated arrays across steps, and SchedulerOutput -> packed tensors.

Each live request owns one row of a token buffer and of a block-table buffer. A step only writes what changed (new
requests, new block ids, sampled tokens) and gathers the batch with a handful of vectorized numpy ops: no Python loop
over the sequences of a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batchserve.core.outputs import SchedulerOutput
from batchserve.layers.attention import AttentionMetadata, SeqGroup
from batchserve.sampling_params import SamplingParams


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [T] int64, packed over the batch
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: rows of the hidden states to sample (last token of each sampled seq)
    req_ids: list[str]  # batch order
    sample_req_ids: list[str]  # the requests sampled this step, in batch order (parallel to logits_indices)
    rows: np.ndarray  # [B] the table row of each request, batch order
    query_lens: np.ndarray  # [B] tokens computed this step
    sample_rows: np.ndarray  # [S] the table row of each sampled request

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class RowTokens(Sequence):
    """A request's token ids (prompt + output so far) as a read-only view of its row."""

    def __init__(self, row: np.ndarray, length: int) -> None:
        self._row, self._length = row, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._row[: self._length][index].tolist()
        if not -self._length <= index < self._length:
            raise IndexError(index)
        return int(self._row[index % self._length])


class RequestTable:
    """Per-request state in arrays indexed by row. Rows and token capacity grow on demand."""

    def __init__(
        self,
        block_size: int,
        rows: int = 64,
        max_tokens: int = 1024,
        scratch_slot: int | None = None,
        deterministic: bool = False,
        long_context_from: int | None = None,
    ):
        self.block_size = block_size
        self.deterministic = deterministic  # every row attends as a decode of its own (_rows_as_decodes)
        self.long_context_from = long_context_from  # LongRoPE: rows with more known tokens are rotated long
        self.scratch_slot = scratch_slot  # a KV slot outside the pool: where padding rows write (static batching)
        self.token_ids = np.zeros((rows, max_tokens), np.int64)
        self.num_tokens = np.zeros(rows, np.int64)
        self.num_computed = np.zeros(rows, np.int64)
        self.block_table = np.zeros((rows, -(-max_tokens // block_size)), np.int64)
        self.num_blocks = np.zeros(rows, np.int64)
        self.num_prompt = np.zeros(rows, np.int64)
        self.params: list[SamplingParams | None] = [None] * rows
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def __len__(self) -> int:
        return len(self.row_of)

    # ---- state changes -------------------------------------------------------------------------------------------
    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Forget finished/preempted requests, add new ones, extend the block tables of continuing ones."""
        for req_id in scheduler_output.finished_req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.params[row] = None
                self._free_rows.append(row)
        for new in scheduler_output.new_requests:
            row = self._take_row()
            self.row_of[new.req_id] = row
            self._ensure_tokens(len(new.token_ids) + 1)
            self.token_ids[row, : len(new.token_ids)] = new.token_ids
            self.num_tokens[row] = len(new.token_ids)
            self.num_computed[row] = new.num_computed_tokens
            self.num_prompt[row] = new.num_prompt_tokens
            self.params[row] = new.sampling_params
            self.num_blocks[row] = 0
            self._append_blocks(row, new.block_ids)
        for cached in scheduler_output.cached_requests:
            row = self.row_of[cached.req_id]
            self.num_computed[row] = cached.num_computed_tokens
            if cached.new_block_ids:
                self._append_blocks(row, cached.new_block_ids)

    def append_sampled(self, rows: np.ndarray, token_ids: list[int]) -> None:
        if not len(rows):
            return
        if int(self.num_tokens[rows].max()) >= self.token_ids.shape[1]:
            self._ensure_tokens(int(self.num_tokens[rows].max()) + 1)
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def tokens(self, row: int) -> RowTokens:
        return RowTokens(self.token_ids[row], int(self.num_tokens[row]))

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        start, end = int(self.num_blocks[row]), int(self.num_blocks[row]) + len(block_ids)
        if end > self.block_table.shape[1]:
            self.block_table = _grow(self.block_table, 1, end)
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _take_row(self) -> int:
        if not self._free_rows:
            old = len(self.num_tokens)
            for name in ("token_ids", "num_tokens", "num_computed", "block_table", "num_blocks", "num_prompt"):
                setattr(self, name, _grow(getattr(self, name), 0, 2 * old))
            self.params += [None] * old
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _ensure_tokens(self, width: int) -> None:
        if width > self.token_ids.shape[1]:
            self.token_ids = _grow(self.token_ids, 1, width)

    # ---- one step's batch ------------------------------------------------------------------------------------------
    def build(self, scheduler_output: SchedulerOutput, device: torch.device) -> InputBatch:
        """Pack the scheduled tokens of every request (in batch order) into flat tensors, with one host->device copy."""
        bs = self.block_size
        scheduled = scheduler_output.num_scheduled_tokens
        # decodes (and verifications of drafts) first, then prefill chunks: each attention path then takes a
        # contiguous range of the batch's tokens (a view), not an index gather and scatter per layer
        drafted = scheduler_output.spec_token_ids
        req_ids = sorted(scheduled, key=lambda r: scheduled[r] != 1 and r not in drafted)
        num_seqs = len(req_ids)
        rows = np.fromiter((self.row_of[r] for r in req_ids), np.int64, num_seqs)
        query_lens = np.fromiter((scheduled[r] for r in req_ids), np.int64, num_seqs)
        starts = self.num_computed[rows]
        seq_lens = starts + query_lens
        self._check(req_ids, rows, seq_lens)
        query_start_loc = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        max_query_len, max_seq_len = int(query_lens.max()), int(seq_lens.max())

        # token t belongs to sequence seq_index[t] and sits at offset[t] in this step's chunk
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        offset = np.arange(num_tokens) - query_start_loc[seq_index]
        positions = starts[seq_index] + offset
        token_rows = rows[seq_index]
        input_ids = self.token_ids[token_rows, positions]
        slot_mapping = self.block_table[token_rows, positions // bs] * bs + positions % bs
        if scheduler_output.padding_req_ids:
            slot_mapping[self._padding_seqs(req_ids, scheduler_output.padding_req_ids)[seq_index]] = self.scratch_slot
        block_tables = self.block_table[rows, : -(-max_seq_len // bs)]
        sampled = np.flatnonzero(seq_lens == self.num_tokens[rows])
        logits_indices = query_start_loc[1:][sampled] - 1
        query_pad_index = seq_index * max_query_len + offset

        host = _HostArrays()
        t = host.add  # every array rides in one host -> device copy
        t("input_ids", input_ids), t("positions", positions), t("slot_mapping", slot_mapping)
        t("query_pad_index", query_pad_index), t("seq_lens", seq_lens), t("query_start_loc", query_start_loc)
        t("logits_indices", logits_indices), t("block_tables", block_tables)
        if self.long_context_from is not None:  # a sequence's known tokens decide, not this step's chunk
            t("long_context", self.num_tokens[token_rows] > self.long_context_from)
        is_decode = query_lens == 1
        if self.deterministic:
            decode, prefill = self._rows_as_decodes(host, token_rows, positions), None
        elif drafted:  # a verified draft attends as the decode it stands for: speculation keeps greedy's tokens
            verified = is_decode | np.fromiter((r in drafted for r in req_ids), bool, num_seqs)
            end = int(query_start_loc[int(verified.sum())])
            decode = self._rows_as_decodes(host, token_rows[:end], positions[:end])
            prefill = self._group(host, "prefill", ~verified, rows, query_start_loc, offset, query_lens, seq_lens)
        else:
            decode = self._group(host, "decode", is_decode, rows, query_start_loc, offset, query_lens, seq_lens)
            prefill = self._group(host, "prefill", ~is_decode, rows, query_start_loc, offset, query_lens, seq_lens)
        dev = host.to(device)
        metadata = _attention_metadata(
            dev, max_query_len, max_seq_len, decode and decode(dev), prefill and prefill(dev)
        )
        return InputBatch(
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            attn_metadata=metadata,
            logits_indices=dev["logits_indices"],
            req_ids=req_ids,
            sample_req_ids=[req_ids[i] for i in sampled],
            rows=rows,
            query_lens=query_lens,
            sample_rows=rows[sampled],
        )

    def _group(self, host, name, selected, rows, query_start_loc, offset, query_lens, seq_lens):
        """Arrays of the sequences taking one attention path (a contiguous run of the batch: decodes are packed
        first); returns a SeqGroup factory over device tensors."""
        if not selected.any():
            return None
        seqs = np.flatnonzero(selected)
        start, stop = int(query_start_loc[seqs[0]]), int(query_start_loc[seqs[-1] + 1])
        group_lens, group_query_lens = seq_lens[seqs], query_lens[seqs]
        max_q = int(group_query_lens.max())
        host.add(f"{name}.seq_lens", group_lens)
        host.add(f"{name}.block_tables", self.block_table[rows[seqs], : -(-int(group_lens.max()) // self.block_size)])
        starts = query_start_loc[seqs[0] : seqs[-1] + 2] - start  # each sequence's first row within the group
        spans = None
        if max_q > 1:
            local = np.repeat(np.arange(len(seqs)), group_query_lens)
            host.add(f"{name}.query_pad_index", local * max_q + offset[start:stop])
            host.add(f"{name}.query_starts", starts)
            contexts = group_lens - group_query_lens
            spans = list(zip(starts[:-1].tolist(), starts[1:].tolist(), contexts.tolist(), strict=True))

        def build(dev: dict[str, torch.Tensor]) -> SeqGroup:
            return SeqGroup(
                token_range=(start, stop),
                block_tables=dev[f"{name}.block_tables"],
                seq_lens=dev[f"{name}.seq_lens"],
                positions=dev["positions"][start:stop],
                max_query_len=max_q,
                query_pad_index=dev.get(f"{name}.query_pad_index"),
                query_starts=dev.get(f"{name}.query_starts"),
                spans=spans,
            )

        return build

    def _rows_as_decodes(self, host, token_rows: np.ndarray, positions: np.ndarray):
        """The first len(positions) rows of the batch each attend as a decode of their own (keys up to the row's
        position, through its sequence's block table; this step's K/V are stored before any row reads). Deterministic
        mode: every row, so a token's attention runs one kernel in one tile order whether it is decoded, prefilled
        whole or in chunks, recomputed after a preemption or prefilled after a prefix-cache hit. Speculation: the
        decodes and the rows that verify drafts, so that a verified token's attention is the decode it would have
        been without drafts. Returns a SeqGroup factory over device tensors."""
        seq_lens = positions + 1
        host.add("rows.seq_lens", seq_lens)
        host.add("rows.block_tables", self.block_table[token_rows, : -(-int(seq_lens.max()) // self.block_size)])
        num_tokens = len(positions)

        def build(dev: dict[str, torch.Tensor]) -> SeqGroup:
            return SeqGroup(
                token_range=(0, num_tokens),
                block_tables=dev["rows.block_tables"],
                seq_lens=dev["rows.seq_lens"],
                positions=dev["positions"][:num_tokens],
                max_query_len=1,
            )

        return build

    def _padding_seqs(self, req_ids: list[str], padding: set[str]) -> np.ndarray:
        """Which sequences are padding. Their K/V goes to the scratch slot, never over the cached K/V of their
        context (a recompute in another batch may differ in the last bits, and a prefix-cache hit may read it)."""
        if self.scratch_slot is None:
            raise ValueError("padding rows need a scratch KV slot")
        return np.fromiter((r in padding for r in req_ids), bool, len(req_ids))

    def _check(self, req_ids: list[str], rows: np.ndarray, seq_lens: np.ndarray) -> None:
        past_known = seq_lens > self.num_tokens[rows]
        short_of_blocks = -(-seq_lens // self.block_size) > self.num_blocks[rows]
        for bad, what in ((past_known, "more tokens than it knows"), (short_of_blocks, "more blocks than it holds")):
            if bad.any():
                raise ValueError(f"request {req_ids[int(np.flatnonzero(bad)[0])]}: scheduled {what}")

    def advance(self, batch: InputBatch) -> None:
        self.num_computed[batch.rows] += batch.query_lens


def _attention_metadata(dev: dict[str, torch.Tensor], max_query_len: int, max_seq_len: int, decode, prefill):
    return AttentionMetadata(
        slot_mapping=dev["slot_mapping"],
        positions=dev["positions"],
        block_tables=dev["block_tables"],
        seq_lens=dev["seq_lens"],
        query_start_loc=dev["query_start_loc"],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_pad_index=dev["query_pad_index"],
        decode=decode,
        prefill=prefill,
        long_context=dev.get("long_context"),
    )


class _HostArrays:
    """int64 numpy arrays gathered into one buffer, so a step makes a single host -> device copy."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        self._arrays[name] = np.ascontiguousarray(array, np.int64)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        arrays = list(self._arrays.values())
        flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays])).to(device)
        pieces = torch.split(flat, [a.size for a in arrays])
        return {name: p.view(a.shape) for (name, a), p in zip(self._arrays.items(), pieces)}


def _grow(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    """A copy of array with dimension `axis` enlarged to at least `size` (doubling), zero-filled."""
    shape = list(array.shape)
    shape[axis] = max(size, 2 * shape[axis])
    grown = np.zeros(shape, array.dtype)
    grown[tuple(slice(0, n) for n in array.shape)] = array
    return grown
