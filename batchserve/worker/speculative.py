"""Exact verification of speculative drafts against the target model's own predictions, in the step that computed
them.

A speculated request's query is its last known token followed by k drafts, so the forward pass gives k + 1 target
distributions: position j predicts the token after draft j - 1. Every distribution is processed as the sampler would
process it had the drafts before it been sampled (penalties, min_tokens, logit bias, temperature, top-k/p, min-p).
- greedy: accept drafts while each equals the target's argmax; then emit the target's argmax at the first mismatch
  (or after the last draft), so the output is what plain greedy decoding gives;
- random: the proposer is deterministic (q is one-hot on the draft), so a draft x is accepted with probability p(x);
  on rejection the token comes from the residual norm(max(p - q, 0)) = p without x, renormalised; after k accepted
  drafts the bonus token comes from p. Each emitted token then follows p exactly. A seeded request draws from one
  generator per output position (seeded as the sampler seeds that position), so its tokens do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchserve.worker.input_batch import InputBatch, RequestTable
from batchserve.worker.sampler import (
    SamplingMetadata,
    _argmax,
    _step_seed,
    apply_penalties,
    sampling_probabilities,
)


@dataclass
class Verified:
    accepted: dict[str, list[int]]  # req_id -> accepted drafts
    next_token: dict[str, int]  # req_id -> the target's token after them


def stage_drafts(table: RequestTable, drafts: dict[str, list[int]]) -> None:
    """Write the drafts after each request's known tokens, so the batch builder schedules them as query tokens."""
    for req_id, tokens in drafts.items():
        row = table.row_of[req_id]
        end = int(table.num_tokens[row]) + len(tokens)
        table._ensure_tokens(end + 1)
        table.token_ids[row, end - len(tokens) : end] = tokens
        table.num_tokens[row] = end


def unstage_drafts(table: RequestTable, drafts: dict[str, list[int]]) -> None:
    """The table knows verified tokens only: the drafts' ids stay in the buffer, past the known count."""
    for req_id, tokens in drafts.items():
        table.num_tokens[table.row_of[req_id]] -= len(tokens)


def draft_hidden_rows(batch: InputBatch, drafts: dict[str, list[int]]) -> tuple[list[str], list[int]]:
    """(speculated req_ids in batch order, the packed rows of their k + 1 query positions)."""
    starts = np.concatenate([[0], np.cumsum(batch.query_lens)])
    req_ids, rows = [], []
    for i, req_id in enumerate(batch.req_ids):
        if req_id in drafts:
            req_ids.append(req_id)
            rows += range(int(starts[i]), int(starts[i + 1]))
    return req_ids, rows


def verify(
    logits: torch.Tensor, table: RequestTable, req_ids: list[str], drafts: dict[str, list[int]],
    eos_token_ids: list[int],
) -> Verified:  # fmt: skip
    """logits: [sum(k + 1), V] float32, k + 1 consecutive rows per request of req_ids."""
    params, contexts, num_prompt = [], [], []
    for req_id in req_ids:
        row = table.row_of[req_id]
        known = table.tokens(row)[:]
        for j in range(len(drafts[req_id]) + 1):
            params.append(table.params[row])
            contexts.append(known + drafts[req_id][:j])
            num_prompt.append(int(table.num_prompt[row]))
    meta = SamplingMetadata.build(params, contexts, num_prompt, eos_token_ids, logits.shape[-1], logits.device)
    logits = _process(logits, meta)
    greedy = _argmax(logits).tolist() if meta.greedy_mask is not None else None
    probs = None if meta.all_greedy else _probabilities(logits, meta)
    result = Verified({}, {})
    first = 0
    for req_id in req_ids:
        proposal, p = drafts[req_id], params[first]
        span = range(first, first + len(proposal) + 1)
        if p.greedy:
            accepted, token = _accept_greedy(proposal, [greedy[r] for r in span])
        else:
            n_out = len(contexts[first]) - num_prompt[first]
            accepted, token = _accept_random(proposal, probs[first : first + len(proposal) + 1], p.seed, n_out)
        result.accepted[req_id], result.next_token[req_id] = accepted, token
        first += len(proposal) + 1
    return result


def _process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The sampler's logit processors, in its order (speculated requests carry no grammar)."""
    if meta.min_tokens_mask is not None:
        logits = logits.index_put(meta.min_tokens_mask, torch.tensor(float("-inf"), device=logits.device))
    if meta.logit_bias is not None:
        logits = logits.index_put(meta.logit_bias[0], meta.logit_bias[1], accumulate=True)
    return apply_penalties(logits, meta)


def _probabilities(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return sampling_probabilities(logits, meta).to(torch.float64)


def _accept_greedy(proposal: list[int], targets: list[int]) -> tuple[list[int], int]:
    for j, token in enumerate(proposal):
        if targets[j] != token:
            return proposal[:j], targets[j]
    return list(proposal), targets[len(proposal)]


def _accept_random(
    proposal: list[int], probs: torch.Tensor, seed: int | None, num_output_tokens: int
) -> tuple[list[int], int]:
    """probs: [k + 1, V] float64 target distributions of this request's positions."""
    index = torch.tensor(proposal, dtype=torch.long, device=probs.device)
    draft_probs = probs[torch.arange(len(proposal), device=probs.device), index].tolist()
    for j, token in enumerate(proposal):
        generator = _generator(seed, num_output_tokens + j)
        uniform = torch.rand(1, generator=generator, dtype=torch.float64).item()
        if uniform < draft_probs[j]:
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        return proposal[:j], _draw(residual, generator)
    return list(proposal), _draw(probs[len(proposal)], _generator(seed, num_output_tokens + len(proposal)))


def _generator(seed: int | None, position: int) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(_step_seed(seed, position))
    return generator


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse CDF over unnormalised weights (a zero weight is never drawn)."""
    cdf = weights.cpu().cumsum(0)
    uniform = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, uniform, right=True).clamp_max_(len(cdf) - 1).item())
