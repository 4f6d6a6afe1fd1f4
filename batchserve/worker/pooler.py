"""Pooling requests in the runner's step (docs/embeddings.md): their prompt's hidden states are pooled (last token,
mean, or first token) as their chunks are computed, and when the prompt is done the pooled vector becomes the
request's result (normalised and truncated, or scored by the classification head) instead of a sampled token."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import torch

from batchserve.config import Convert
from batchserve.core.outputs import SchedulerOutput
from batchserve.pooling_params import PoolingParams
from batchserve.worker.input_batch import InputBatch, RequestTable
from batchserve.worker.pooling_model import PoolerConfig

MAX_PARKED = 4096


class Pooler:
    """Per-request partial pools across a prompt's chunks (mean: a float32 sum; cls: the first position), and the
    results of the latest step, taken once by the runner."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._partial: dict[str, torch.Tensor] = {}
        # partial pools of requests the worker forgot (finished, aborted, preempted): a swapped-out one takes its
        # back when it resumes past its first position; bounded, oldest first out (an aborted one never returns)
        self._parked: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._outputs: dict[str, torch.Tensor] = {}

    def follow(self, scheduler_output: SchedulerOutput) -> None:
        """The requests the worker forgets and (re)admits this step, as the request table follows them."""
        for req_id in scheduler_output.finished_req_ids:
            partial = self._partial.pop(req_id, None)
            if partial is not None:
                self._parked[req_id] = partial
                while len(self._parked) > MAX_PARKED:
                    self._parked.popitem(last=False)
        for new in scheduler_output.new_requests:
            parked = self._parked.pop(new.req_id, None)
            if parked is not None and new.num_computed_tokens > 0:  # swapped in: its K/V and its pool resume
                self._partial[new.req_id] = parked

    def pool(self, batch: InputBatch, hidden: torch.Tensor, table: RequestTable) -> InputBatch:
        """Pool this step's rows of the pooling requests (before the table advances); the ones whose prompt is now
        done get their results. Returns the batch with only the generation requests left to sample."""
        starts = np.concatenate(([0], np.cumsum(batch.query_lens)))
        done_ids: list[str] = []
        done_vectors: list[torch.Tensor] = []
        for index, req_id in enumerate(batch.req_ids):
            row = int(batch.rows[index])
            params = table.params[row]
            if params is None or params.pooling is None:
                continue
            begin, end = int(starts[index]), int(starts[index + 1])
            computed = int(table.num_computed[row])
            vector = self._accumulate(req_id, hidden, begin, end, computed)
            if computed + end - begin == int(table.num_tokens[row]):
                done_ids.append(req_id)
                done_vectors.append(vector if vector is not None else self._partial.pop(req_id))
        if done_ids:
            self._finish(done_ids, done_vectors, table)
        pooled = set(done_ids)
        keep = [i for i, req_id in enumerate(batch.sample_req_ids) if req_id not in pooled]
        if len(keep) == len(batch.sample_req_ids):
            return batch
        index = torch.tensor(keep, dtype=torch.long, device=batch.logits_indices.device)
        return dataclasses.replace(
            batch,
            sample_req_ids=[batch.sample_req_ids[i] for i in keep],
            sample_rows=batch.sample_rows[keep],
            logits_indices=batch.logits_indices.index_select(0, index),
        )

    def _accumulate(self, req_id: str, hidden: torch.Tensor, begin: int, end: int, computed: int):
        """The step's chunk folded into the request's partial pool; for last-token pooling the chunk's last row."""
        method = self.config.method
        if method == "last":
            return hidden[end - 1]
        if method == "cls":
            if computed == 0:
                self._partial[req_id] = hidden[begin].float()
            return None
        chunk = hidden[begin:end].float().sum(0)
        total = self._partial.get(req_id)
        self._partial[req_id] = chunk if total is None else total + chunk
        return None

    def _finish(self, req_ids: list[str], vectors: list[torch.Tensor], table: RequestTable) -> None:
        stacked = torch.stack([v.float() for v in vectors])
        if self.config.method == "mean":
            counts = [int(table.num_tokens[table.row_of[r]]) for r in req_ids]
            stacked = stacked / torch.tensor(counts, dtype=stacked.dtype, device=stacked.device).unsqueeze(1)
        for req_id in req_ids:
            self._partial.pop(req_id, None)
        params = [table.params[table.row_of[r]].pooling for r in req_ids]
        if self.config.task == Convert.CLASSIFY:
            results = list(self._scores(stacked).cpu())
        else:
            results = [self._embedding(v, p) for v, p in zip(stacked.cpu(), params)]
        self._outputs.update(zip(req_ids, results))

    def _scores(self, pooled: torch.Tensor) -> torch.Tensor:
        """One probability per label: sigmoid of a single logit (a cross-encoder's relevance), else softmax."""
        head = self.config.head.to(pooled.device)
        logits = pooled @ head.T
        return torch.sigmoid(logits) if head.shape[0] == 1 else torch.softmax(logits, dim=-1)

    def _embedding(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector

    def take_outputs(self) -> dict[str, torch.Tensor]:
        outputs, self._outputs = self._outputs, {}
        return outputs
