"""A model-free runner that really uses the paged KV cache, for scheduler and engine tests.

It "stores K/V" by writing each computed token id into its slot of a flat cache (slot = block * block_size +
offset), and samples the next token as a hash of the tokens it READS BACK through the block table. If the
scheduler or block manager hands out a wrong block table, a shared prefix block with other content, or a block
that is overwritten while still in use, the sampled tokens differ from `reference_next_token(true sequence)`.

Options for engine and server tests: `delay_s` sleeps that long in every non-empty step (so streams, queues and step
timing are observable), and setting the `crash` event (or passing one already set) makes the next step raise, as a
failed device would.
"""

from __future__ import annotations

import threading
import time
import zlib

from batchserve.core.outputs import ModelOutput, RunnerTimings, SchedulerOutput


def reference_next_token(tokens: list[int], vocab_size: int) -> int:
    return zlib.crc32(str(tokens).encode()) % vocab_size


class FakeRunner:
    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        num_swap_blocks: int = 0,
        delay_s: float = 0.0,
        crash: threading.Event | None = None,
        max_kv_blocks: int | None = None,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.max_kv_blocks = num_kv_blocks if max_kv_blocks is None else max_kv_blocks  # > num_kv_blocks: it grows
        self.resizes: list[tuple[int, int]] = []  # (num_blocks, blocks kept) of every resize_kv_cache()
        self.num_swap_blocks = num_swap_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.cache: list[int | None] = [None] * (num_kv_blocks * block_size)
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(num_swap_blocks)]
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.steps: list[SchedulerOutput] = []
        self.last_timings = RunnerTimings()  # nothing is timed: the engine's step split reads zeros
        self.delay_s = delay_s
        self.crash = crash if crash is not None else threading.Event()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def resize_kv_cache(self, num_blocks: int, keep_block_ids) -> None:
        """As ModelRunner's: only the blocks in keep_block_ids keep their slots, every other slot is lost, so a block
        the engine believed cached but did not keep would read back None and change the sampled tokens."""
        assert self.num_kv_blocks <= num_blocks <= self.max_kv_blocks, (self.num_kv_blocks, num_blocks)
        kept = [None] * (num_blocks * self.block_size)
        for block in keep_block_ids:
            span = slice(block * self.block_size, (block + 1) * self.block_size)
            kept[span] = self.cache[span]
        self.cache = kept
        self.num_kv_blocks = num_blocks
        self.resizes.append((num_blocks, len(keep_block_ids)))

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        if self.crash.is_set():
            raise RuntimeError("simulated device failure")
        if self.delay_s and not out.is_empty:
            time.sleep(self.delay_s)
        self.steps.append(out)
        for rid in out.finished_req_ids:
            self.tokens.pop(rid, None)
            self.tables.pop(rid, None)
        bs = self.block_size
        for dev, host in out.blocks_to_swap_out:
            self.host[host] = self.cache[dev * bs : (dev + 1) * bs]
        for dev, host in out.blocks_to_swap_in:
            self.cache[dev * bs : (dev + 1) * bs] = self.host[host]
        computed: dict[str, int] = {}
        for new in out.new_requests:
            self.tokens[new.req_id] = list(new.token_ids)
            self.tables[new.req_id] = list(new.block_ids)
            computed[new.req_id] = new.num_computed_tokens
        for cached in out.cached_requests:
            self.tables[cached.req_id] += cached.new_block_ids
            computed[cached.req_id] = cached.num_computed_tokens
        # write every scheduled token first (as each layer does), then read
        for rid, n in out.num_scheduled_tokens.items():
            table, start = self.tables[rid], computed[rid]
            assert start + n <= len(self.tokens[rid]), "scheduled past the known tokens"
            if rid in out.padding_req_ids:
                assert n == 1 and start + n < len(self.tokens[rid]), "padding recomputes a known position"
                continue  # as the real runner: padding K/V goes to a scratch slot
            for pos in range(start, start + n):
                self.cache[table[pos // bs] * bs + pos % bs] = self.tokens[rid][pos]
        result = ModelOutput()
        for rid, n in out.num_scheduled_tokens.items():
            if computed[rid] + n != len(self.tokens[rid]):
                continue
            table = self.tables[rid]
            seen = [self.cache[table[p // bs] * bs + p % bs] for p in range(len(self.tokens[rid]))]
            token = reference_next_token(seen, self.vocab_size)
            self.tokens[rid].append(token)
            result.req_ids.append(rid)
            result.sampled_token_ids.append(token)
        return result


def reference_generation(prompt: list[int], max_tokens: int, vocab_size: int = 1000) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(reference_next_token(tokens, vocab_size))
    return tokens[len(prompt) :]
