"""Speculative method draft_model: a smaller model with the target's tokenizer proposes the next k tokens of each
sequence, greedily, after the target's step; the scheduler schedules them as drafts in the next step and the target
verifies them (worker/speculative.py) as it verifies any proposal.

The draft model runs in a ModelRunner of its own, over a KV pool of its own that core's KVCacheManager manages with
prefix caching on. Each round every sequence is admitted anew with the target's tokens: the blocks it computed in
earlier rounds come back as a prefix-cache hit, so a draft the target rejected never needs rolling back (its blocks
hold other tokens and are never found again), and a round costs the sequence's unfinished last block plus k steps.
"""

from __future__ import annotations

from batchserve.core.block_pool import BlockPool
from batchserve.core.kv_cache_manager import KVCacheManager
from batchserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from batchserve.request import Request
from batchserve.sampling_params import SamplingParams
from batchserve.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, target_vocab_size: int) -> None:
        self.runner = runner
        self.kv = KVCacheManager(BlockPool(runner.num_kv_blocks, enable_caching=True), runner.block_size)
        self.target_vocab_size = target_vocab_size  # a draft past the target's vocabulary ends the proposal
        self._admitted: set[str] = set()  # last round's sequences: the runner forgets them at the next round

    def propose(self, sequences: dict[str, list[int]], k: int) -> dict[str, list[int]]:
        """req_id -> its known tokens (prompt and output) => req_id -> up to k draft tokens to follow them."""
        mirrors = self._admit(sequences)
        drafts: dict[str, list[int]] = {r.request_id: [] for r in mirrors}
        step = self._first_step(mirrors)
        for _ in range(k):
            if step.is_empty:
                break
            output = self.runner.execute(step)
            for req_id, token in zip(output.req_ids, output.sampled_token_ids):
                drafts[req_id].append(token)
            step = self._next_step(mirrors, drafts, k)
        for mirror in mirrors:
            self.kv.free(mirror)  # its blocks stay findable by content for the next round
        return {req_id: valid for req_id, tokens in drafts.items() if (valid := self._valid(tokens))}

    def _valid(self, tokens: list[int]) -> list[int]:
        """Up to the first token past the target's vocabulary (a draft model may have a larger, padded one)."""
        for i, token in enumerate(tokens):
            if token >= self.target_vocab_size:
                return tokens[:i]
        return tokens

    def _admit(self, sequences: dict[str, list[int]]) -> list[Request]:
        """A fresh request per sequence, holding blocks for its uncached tokens (None left out: the pool is full)."""
        mirrors = []
        for req_id, tokens in sequences.items():
            mirror = Request(req_id, list(tokens), GREEDY)
            hit = self.kv.find_prefix_hit(mirror)
            if self.kv.allocate(mirror, mirror.num_tokens - hit.num_tokens, hit) is not None:
                mirrors.append(mirror)
        return mirrors

    def _first_step(self, mirrors: list[Request]) -> SchedulerOutput:
        step = SchedulerOutput(finished_req_ids=self._admitted)
        self._admitted = {m.request_id for m in mirrors}
        for mirror in mirrors:
            num_new = mirror.num_tokens - mirror.num_computed_tokens
            step.new_requests.append(
                NewRequestData(
                    mirror.request_id,
                    list(mirror.prompt_token_ids),
                    mirror.num_prompt_tokens,
                    GREEDY,
                    self.kv.block_ids(mirror),
                    mirror.num_computed_tokens,
                )
            )
            step.num_scheduled_tokens[mirror.request_id] = num_new
            mirror.num_computed_tokens += num_new
        return step

    def _next_step(self, mirrors: list[Request], drafts: dict[str, list[int]], k: int) -> SchedulerOutput:
        """One more token for each sequence whose proposal is still growing: its last draft is computed now."""
        step = SchedulerOutput()
        for mirror in mirrors:
            tokens = drafts[mirror.request_id]
            if len(tokens) >= k or len(tokens) == mirror.num_output_tokens or tokens[-1] >= self.target_vocab_size:
                continue  # done, not sampled this step, or a token the target cannot take
            mirror.output_token_ids.append(tokens[-1])
            new_blocks = self.kv.allocate(mirror, 1)
            if new_blocks is None:
                continue  # the pool is full: this proposal stops here
            step.cached_requests.append(CachedRequestData(mirror.request_id, new_blocks, mirror.num_computed_tokens))
            step.num_scheduled_tokens[mirror.request_id] = 1
            mirror.num_computed_tokens += 1
        return step
