"""Prompt-token logprobs (scoring: completions' echo + logprobs, vLLM's prompt_logprobs), computed in the batched
prefill: the logits at the prompt positions of the requests that ask, all of a step's in one lm_head call. Position
j's logits score prompt token j + 1; the first prompt token has no score (None). A prompt prefilled in chunks gathers
its scores chunk by chunk; they leave the worker with the request's first sampled token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchserve.core.outputs import Logprobs, NewRequestData
from batchserve.worker.input_batch import InputBatch, RequestTable


@dataclass
class PromptScoring:
    """One step's prompt positions to score: packed rows of the hidden states, the token each row predicts, and
    which request (and how many top alternatives) each row belongs to."""

    packed_rows: torch.Tensor  # [R] long
    targets: torch.Tensor  # [R] long
    req_ids: list[str]  # [R]
    num_top: list[int]  # [R]


class PromptLogprobs:
    def __init__(self) -> None:
        self._pending: dict[str, list[Logprobs | None]] = {}
        self._scoring: set[str] = set()  # requests in the worker that asked (none: plan() costs nothing)

    def follow(self, new_requests: list[NewRequestData], finished_req_ids: set[str]) -> None:
        self.forget(finished_req_ids)
        self._scoring.update(r.req_id for r in new_requests if r.sampling_params.prompt_logprobs is not None)

    def plan(self, table: RequestTable, batch: InputBatch, device: torch.device) -> PromptScoring | None:
        """Call before the table advances (it reads each request's computed count before this step)."""
        if not self._scoring:
            return None
        packed, targets, req_ids, num_top = [], [], [], []
        offset = 0
        for req_id, row, query_len in zip(batch.req_ids, batch.rows.tolist(), batch.query_lens.tolist()):
            params = table.params[row]
            start, num_prompt = int(table.num_computed[row]), int(table.num_prompt[row])
            scoring = params is not None and params.prompt_logprobs is not None
            if scoring and table.num_tokens[row] == num_prompt and start < num_prompt:  # never on a recompute
                if start == 0:
                    self._pending[req_id] = [None]
                end = min(start + query_len, num_prompt - 1)  # the last prompt position predicts an output token
                positions = np.arange(start, max(start, end))
                packed += (offset + positions - start).tolist()
                targets += table.token_ids[row, positions + 1].tolist()
                req_ids += [req_id] * len(positions)
                num_top += [params.prompt_logprobs] * len(positions)
            offset += query_len
        if not packed:
            return None
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return PromptScoring(as_long(packed), as_long(targets), req_ids, num_top)

    def score(self, logits: torch.Tensor, scoring: PromptScoring) -> None:
        """`logits`: [R, V] at scoring.packed_rows."""
        logprobs = logits.float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, scoring.targets.unsqueeze(1))
        rank = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        k = max(scoring.num_top)
        top_logprob, top_id = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        chosen, targets = chosen.squeeze(1).tolist(), scoring.targets.tolist()
        top_logprob, top_id = top_logprob.tolist(), top_id.tolist()
        for i, req_id in enumerate(scoring.req_ids):
            n = scoring.num_top[i]
            top = dict(zip(top_id[i][:n], top_logprob[i][:n], strict=True))
            self._pending[req_id].append(Logprobs(targets[i], chosen[i], rank[i], top))

    def take(self, req_ids: list[str]) -> dict[str, list[Logprobs | None]]:
        """The scores of the requests sampled this step (their prompt is complete)."""
        return {r: self._pending.pop(r) for r in req_ids if r in self._pending}

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._pending.pop(req_id, None)
            self._scoring.discard(req_id)
