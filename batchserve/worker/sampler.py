"""Batched sampling: every request's SamplingParams applied to one [N, V] logits tensor in a few vectorized ops.

Order (as vLLM v1): grammar mask (structured outputs) -> min_tokens mask -> logit_bias -> penalties -> greedy argmax, or temperature -> min_p -> top_k/top_p -> draw.
Logprobs come from the raw model logits (vLLM's default "raw_logprobs"), so they never depend on the knobs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from batchserve.core.outputs import Logprobs
from batchserve.layers import kernels
from batchserve.sampling_params import SamplingParams
from batchserve.worker.structured_output import apply_token_bitmask

_NEG_INF = float("-inf")


def _step_seed(seed: int, num_output_tokens: int) -> int:
    """Generator seed for one (request seed, position): a pure function of the two, so a request draws the same token
    at the same position whatever else is in the batch and after a preemption recomputes it."""
    return (seed * 1_000_003 + num_output_tokens) % 2**64


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] float count of each token id per row. Rows are padded with the id `vocab_size`, which lands in a
    scratch column that is dropped, so one scatter_add counts every token with no per-token Python."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.tensor([r + [vocab_size] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    padded = padded.view(len(rows), width)  # keeps the shape when every row is empty
    counts = torch.zeros(len(rows), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


@dataclass
class SamplingMetadata:
    """One step's sampling state as device tensors, built once. A None field means no row uses that feature, which
    is what lets the sampler skip it (all-greedy without penalties is a bare argmax)."""

    all_greedy: bool
    greedy_mask: torch.Tensor | None  # [N] bool; None when no row is greedy
    temperature: torch.Tensor | None  # [N, 1]; 1.0 on greedy rows so the division is always safe
    top_k: torch.Tensor | None  # [N, 1] long; vocab_size where off
    top_p: torch.Tensor | None  # [N, 1]; 1.0 where off
    min_p: torch.Tensor | None  # [N, 1]; 0.0 where off
    repetition_penalty: torch.Tensor | None  # [N, 1]
    seen_mask: torch.Tensor | None  # [N, V] bool: token occurs in prompt or output
    presence_penalty: torch.Tensor | None  # [N, 1]
    frequency_penalty: torch.Tensor | None  # [N, 1]
    output_counts: torch.Tensor | None  # [N, V] float: occurrences in the output so far
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf
    logit_bias: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None  # ((rows, token ids), biases)
    seeds: list[tuple[int, int]]  # (row, generator seed for this step) of random rows with a seed
    has_unseeded_random: bool
    num_logprobs: list[int | None]
    max_num_logprobs: int | None
    token_bitmask: torch.Tensor | None = None  # [N, ceil(V / 32)] int32: the tokens each row's grammar allows

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        token_ids: Sequence[Sequence[int]],
        num_prompt_tokens: list[int],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingMetadata:
        num_outputs = [len(ids) - n for ids, n in zip(token_ids, num_prompt_tokens, strict=True)]

        def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

        def if_any(values: list, off, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
            return column(values, dtype) if any(v != off for v in values) else None

        # Sampling knobs only matter on random rows: a greedy row's top_k must not force the sort path.
        top_k = [vocab_size if p.greedy or not 0 < p.top_k < vocab_size else p.top_k for p in params]
        top_p = [1.0 if p.greedy else p.top_p for p in params]
        min_p = [0.0 if p.greedy else p.min_p for p in params]

        seen_mask, output_counts = _penalty_counts(params, token_ids, num_prompt_tokens, vocab_size, device)
        min_tokens_mask = _min_tokens_mask(params, num_outputs, eos_token_ids, vocab_size, device)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy, any_greedy = all(p.greedy for p in params), any(p.greedy for p in params)
        return cls(
            all_greedy=all_greedy,
            greedy_mask=torch.tensor([p.greedy for p in params], device=device) if any_greedy else None,
            temperature=None if all_greedy else column([1.0 if p.greedy else p.temperature for p in params]),
            top_k=if_any(top_k, vocab_size, torch.long),
            top_p=if_any(top_p, 1.0),
            min_p=if_any(min_p, 0.0),
            repetition_penalty=column([p.repetition_penalty for p in params]) if seen_mask is not None else None,
            seen_mask=seen_mask,
            presence_penalty=column([p.presence_penalty for p in params]) if output_counts is not None else None,
            frequency_penalty=column([p.frequency_penalty for p in params]) if output_counts is not None else None,
            output_counts=output_counts,
            min_tokens_mask=min_tokens_mask,
            logit_bias=_logit_bias(params, vocab_size, device),
            seeds=[
                (i, _step_seed(p.seed, n_out))
                for i, (p, n_out) in enumerate(zip(params, num_outputs, strict=True))
                if not p.greedy and p.seed is not None
            ],
            has_unseeded_random=any(not p.greedy and p.seed is None for p in params),
            num_logprobs=[p.logprobs for p in params],
            max_num_logprobs=max(asked) if asked else None,
            token_bitmask=token_bitmask,
        )


def _penalty_counts(
    params: list[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: list[int],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(seen mask for repetition penalties, output token counts for presence/frequency penalties), each None when
    no row uses it. Penalties apply to greedy rows too; rows that don't use one contribute no tokens to its counts."""
    seen_mask = output_counts = None
    if any(p.repetition_penalty != 1.0 for p in params):
        rows = [list(ids) if p.repetition_penalty != 1.0 else [] for p, ids in zip(params, token_ids, strict=True)]
        seen_mask = _token_counts(rows, vocab_size, device) > 0
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        rows = [
            list(ids[n:]) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 else []
            for p, ids, n in zip(params, token_ids, num_prompt_tokens, strict=True)
        ]
        output_counts = _token_counts(rows, vocab_size, device)
    return seen_mask, output_counts


def _min_tokens_mask(
    params: list[SamplingParams], num_outputs: list[int], eos_token_ids: list[int], vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """(rows, token ids) that can't be sampled yet: below min_tokens, EOS (even with ignore_eos) and stop tokens."""
    mask_rows, mask_ids = [], []
    eos = None  # built only in a step where some request is below its min_tokens
    for i, (p, n_out) in enumerate(zip(params, num_outputs, strict=True)):
        if n_out < p.min_tokens:
            if eos is None:
                eos = torch.tensor([t for t in eos_token_ids if t < vocab_size], dtype=torch.long)
            # the stop ids sorted once per request, read as a tensor without a copy: a long list costs once, not at
            # every step; a repeat of an EOS id is harmless (both write -inf)
            ids = eos
            if num_stop := bisect.bisect_left(p.sorted_stop_token_ids, vocab_size):
                ids = torch.cat([eos, torch.frombuffer(p.sorted_stop_token_array, dtype=torch.long)[:num_stop]])
            mask_rows.append(torch.full((len(ids),), i, dtype=torch.long))
            mask_ids.append(ids)
    if not mask_rows or not sum(len(ids) for ids in mask_ids):
        return None
    return torch.cat(mask_rows).to(device), torch.cat(mask_ids).to(device)


def _logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """Every row's biases as one sparse (rows, token ids) -> bias triple, added with a single index_put."""
    rows, ids, biases = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < vocab_size:  # the engine refuses others; a padded vocabulary may be larger than the model's
                rows.append(i)
                ids.append(token_id)
                biases.append(bias)
    if not rows:
        return None
    index = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
    return index, torch.tensor(biases, dtype=torch.float32, device=device)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] long
    logprobs: list[Logprobs | None] | None  # per row; None when no row asked


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """HF repetition penalty over prompt + output (divide a seen token's positive logit, multiply a negative one),
    then OpenAI frequency/presence penalties over output tokens only. Out of place: raw logits stay for logprobs."""
    if meta.seen_mask is not None:
        penalty = meta.repetition_penalty
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(meta.seen_mask, penalized, logits)
    if meta.output_counts is not None:
        counts = meta.output_counts
        logits = logits - meta.frequency_penalty * counts - meta.presence_penalty * (counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob. In log space that's logit < max logit + log(min_p), so no softmax
    is needed, and min_p = 0 gives -inf: nothing dropped."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """One descending sort for the whole batch. top_k keeps the first k sorted positions; top_p then keeps the
    smallest prefix whose mass reaches p (a token stays while the mass before it is < p, so the top one always
    stays). The stable sort breaks ties by lower id, as argmax does, so top_k=1 and tiny top_p equal greedy."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        positions = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(positions >= top_k, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # rows with p = 1 are skipped outright: rounding could otherwise make the mass before a tail token >= 1
        sorted_logits = sorted_logits.masked_fill((mass_before >= top_p) & (top_p < 1.0), _NEG_INF)
    # Back to vocab order, so a seeded row's draw doesn't depend on whether some other row needed the sort.
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_probabilities(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a row samples from: its logits over the temperature, then min-p, top-k and top-p."""
    logits = logits / meta.temperature
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return logits.softmax(dim=-1)


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    probs = sampling_probabilities(logits, meta)
    # Inverse CDF: one uniform draw per row, located in the row's cumulative distribution (float64, so the tail of a
    # 50k-token vocabulary keeps its mass). One random number per row instead of one per token: torch's per-element
    # exponential draws cost ~40% of a 64-sequence step. Unseeded rows share one RNG call; each seeded row draws from
    # its own generator, so its choice does not depend on the rest of the batch.
    uniform = torch.empty(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    if meta.has_unseeded_random:
        uniform.uniform_()
    for row, seed in meta.seeds:
        generator = torch.Generator(device=probs.device).manual_seed(seed)
        uniform[row] = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    # right=True: the first token whose cumulative mass exceeds the draw; a zero-probability (masked) token adds no
    # mass, so it can never be that token.
    chosen = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)
    return chosen.clamp_max_(probs.shape[-1] - 1).squeeze(1)


def _logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata) -> list[Logprobs | None]:
    rows = [i for i, k in enumerate(meta.num_logprobs) if k is not None]
    logprobs = raw_logits[rows].log_softmax(dim=-1)
    sampled = token_ids[rows].unsqueeze(1)
    sampled_logprob = logprobs.gather(1, sampled)
    rank = (logprobs > sampled_logprob).sum(dim=-1) + 1
    top_logprob, top_id = logprobs.topk(meta.max_num_logprobs, dim=-1)
    # One device->host copy per tensor, then plain Python to build the records.
    sampled, sampled_logprob, rank = sampled.squeeze(1).tolist(), sampled_logprob.squeeze(1).tolist(), rank.tolist()
    top_logprob, top_id = top_logprob.tolist(), top_id.tolist()
    out: list[Logprobs | None] = [None] * len(meta.num_logprobs)
    for j, row in enumerate(rows):
        k = meta.num_logprobs[row]
        top = dict(zip(top_id[j][:k], top_logprob[j][:k], strict=True))
        out[row] = Logprobs(token_id=sampled[j], logprob=sampled_logprob[j], rank=rank[j], top=top)
    return out


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1): the native kernel (a vectorized max, then a scan for its first index) is ~3x torch at 64
    rows of a 49k vocabulary."""
    native = kernels.for_tensors(logits)
    if native is not None and logits.dim() == 2 and logits.stride(1) == 1:
        return native.argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw_logits = logits = logits.float()
        if meta.token_bitmask is not None:  # first: no knob may bring back a token the grammar forbids
            # in place unless logprobs need the raw logits (the runner's logits are not read after sampling)
            logits = apply_token_bitmask(logits, meta.token_bitmask, in_place=meta.max_num_logprobs is None)
        if meta.min_tokens_mask is not None:
            logits = logits.index_put(meta.min_tokens_mask, torch.tensor(_NEG_INF, device=logits.device))
        if meta.logit_bias is not None:  # out of place: the raw logits stay for logprobs
            logits = logits.index_put(meta.logit_bias[0], meta.logit_bias[1], accumulate=True)
        logits = apply_penalties(logits, meta)
        greedy = _argmax(logits) if meta.greedy_mask is not None else None
        if meta.all_greedy:
            token_ids = greedy
        else:
            token_ids = _sample_random(logits, meta)
            if greedy is not None:
                token_ids = torch.where(meta.greedy_mask, greedy, token_ids)
        logprobs = _logprobs(raw_logits, token_ids, meta) if meta.max_num_logprobs is not None else None
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
