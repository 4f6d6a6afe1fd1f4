"""Per-request block tables over a BlockPool: prefix-cache lookup, on-demand allocation, free, swap bookkeeping."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchserve.core.block_pool import BlockKey, BlockPool, HostBlockPool, KVBlock
from batchserve.core.lora_schedule import first_parent
from batchserve.core.retention import WaitingNeeds, retain
from batchserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchserve.core.kv_offload import KVOffload


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def token_range(request: Request, start: int, end: int) -> tuple[int, ...]:
    """request.all_token_ids[start:end] without concatenating the whole sequence."""
    prompt, n_prompt = request.prompt_token_ids, request.num_prompt_tokens
    if end <= n_prompt:
        return tuple(prompt[start:end])
    output = request.output_token_ids
    if start >= n_prompt:
        return tuple(output[start - n_prompt : end - n_prompt])
    return tuple(prompt[start:]) + tuple(output[: end - n_prompt])


@dataclass
class PrefixHit:
    """The longest run of cached full blocks at the start of a request, not yet owned by it."""

    blocks: list[KVBlock]
    num_tokens: int  # the pool's blocks and the tier's
    tier_digests: list[bytes] = field(default_factory=list)  # the disk tier's blocks after the pool's (read back)


@dataclass
class TierLoad:
    """A waiting request's prefix being read back from the disk tier into blocks it holds (core/kv_offload.py)."""

    request: Request
    future: Future  # -> how many of its tier blocks arrived, in order up to the first missing or bad one
    first: int  # the index of its first tier block in its table (the pool's hit blocks come before)


@dataclass
class SwapInPlan:
    new_block_ids: list[int]
    pairs: list[tuple[int, int]]  # (device block, host block)


class KVCacheManager:
    """`sliding_window` (tokens; only when every attention layer is windowed): blocks whose every token is older
    than the window are returned to the pool while the request runs, and its table keeps the pool's null block in
    their place so later positions still index correctly (attention masks those positions: docs/loading.md)."""

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        host_pool: HostBlockPool | None = None,
        sliding_window: int | None = None,
    ) -> None:
        self.pool = block_pool
        self.sliding_window = sliding_window
        self.null_block = block_pool.reserve_null_block() if sliding_window else None
        self.req_first_live: dict[str, int] = {}  # windowed: table entries before this index are the null block
        self.block_size = block_size
        self.host_pool = host_pool or HostBlockPool(0)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_keys: dict[str, list[BlockKey]] = {}  # keys of its full blocks, in order
        self.req_host_blocks: dict[str, list[int]] = {}  # swapped-out requests
        self.prefix_queries = 0  # prompt tokens looked up, since start
        self.prefix_hits = 0  # prompt tokens found
        self.tier: KVOffload | None = None  # the disk tier under the pool (core/kv_offload.py), when on
        self.waiting_needs = (
            WaitingNeeds()
        )  # blocks the waiting queue's head will hit: evicted last (core/retention.py)
        self.tier_loads: dict[str, TierLoad] = {}
        self._release_after_load: list[tuple[Future, list[KVBlock]]] = []  # a loading request's blocks, once done

    # ---- lookup -------------------------------------------------------------------------------------------
    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Cached blocks covering the request's known tokens, leaving at least one token to compute
        (the forward pass must produce logits at the last position)."""
        if not self.pool.enable_caching or _scores_prompt(request) or request.request_id in self.req_blocks:
            return PrefixHit([], 0)  # (a waiting request holds blocks only while, or after, the tier reads them back)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        keys: list[BlockKey] = []
        tier: list[bytes] = []
        parent = first_parent(request)
        for i in range(max_blocks):
            key = BlockKey(parent, token_range(request, i * self.block_size, (i + 1) * self.block_size))
            keys.append(key)
            block = None if tier else self.pool.lookup(key)
            if block is not None:
                blocks.append(block)
            elif self.tier is None or not self.tier.holds(self.tier.digests(request, keys)[i]):
                break
            else:
                tier.append(self.tier.digests(request, keys)[i])
            parent = key.hash
        return PrefixHit(blocks, (len(blocks) + len(tier)) * self.block_size, tier)

    def record_prefix_query(self, request: Request, hit: PrefixHit) -> None:
        self.prefix_queries += request.num_prompt_tokens
        self.prefix_hits += min(hit.num_tokens, request.num_prompt_tokens)

    # ---- allocation -----------------------------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Free blocks consumed by allocate(): new blocks plus hit blocks that must leave the free queue."""
        held = len(self.req_blocks.get(request.request_id, ()))
        hit_blocks = hit.blocks if hit else []
        computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        new = max(0, cdiv(computed + num_new_tokens, self.block_size) - held - len(hit_blocks))
        return max(0, new - self._num_out_of_window(request)) + sum(1 for b in hit_blocks if b.ref_count == 0)

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> list[int] | None:
        """Room for num_new_tokens more tokens (after taking the hit blocks). None, changing nothing, if it can't."""
        held = self.req_blocks.get(request.request_id)
        self._release_out_of_window(request)
        end = request.num_computed_tokens + num_new_tokens
        if held is not None and hit is None and end <= len(held) * self.block_size:  # most decodes: room already held
            self._register_full_blocks(request, end)
            return []
        if self.blocks_needed(request, num_new_tokens, hit) > self.pool.num_free_blocks:
            return None
        blocks = self.req_blocks.setdefault(request.request_id, [])
        start = len(blocks)
        added: list[KVBlock] = []
        if hit and hit.blocks:
            self.pool.take_cached(hit.blocks)
            added += hit.blocks
            request.num_computed_tokens += len(hit.blocks) * self.block_size
        loaded = self.tier.read(hit.tier_digests) if hit and hit.tier_digests and self.tier else []
        request.num_computed_tokens += len(loaded) * self.block_size  # a missing or bad block on is recomputed
        blocks += added
        self._release_out_of_window(request)
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        fresh = self.pool.take_new(max(0, total - len(blocks)))
        blocks += fresh
        if loaded:
            self.tier.loads += [(b.block_id, payload) for b, payload in zip(fresh, loaded)]
        self._register_full_blocks(
            request, request.num_computed_tokens + num_new_tokens, len(blocks) - len(fresh), len(loaded)
        )
        return [b.block_id for b in blocks[start:]]  # hit blocks already out of the window: the null block

    def _register_full_blocks(
        self, request: Request, num_tokens: int, loaded_from: int = 0, num_loaded: int = 0
    ) -> None:
        """Blocks that will be full once this step runs become findable by content. Their tokens are known now:
        a step computes only tokens that are already in the request. The disk tier writes the new ones, except the
        blocks [loaded_from, loaded_from + num_loaded) it is reading back."""
        if not self.pool.enable_caching:
            return
        num_tokens = min(num_tokens, request.num_tokens)  # speculative drafts are not known tokens: never hashed
        keys = self.req_keys.setdefault(request.request_id, [])
        blocks = self.req_blocks[request.request_id]
        for i in range(len(keys), num_tokens // self.block_size):
            parent = keys[-1].hash if keys else first_parent(request)
            key = BlockKey(parent, token_range(request, i * self.block_size, (i + 1) * self.block_size))
            keys.append(key)
            if blocks[i] is not self.null_block:  # a block that left the window is released, not registered
                self.pool.register(blocks[i], key)
                retain(self.pool, blocks[i], request, i, self.block_size)
            if self.tier is not None and blocks[i].key is key:  # registered here, not a private duplicate
                digest = self.tier.digests(request, keys)[i]
                self.tier.registered(request, i, blocks[i].block_id, digest, 0 <= i - loaded_from < num_loaded)

    # ---- reading a prefix back from the disk tier without stopping the steps --------------------------------
    def reads_back(self, request: Request, hit: PrefixHit, wait: bool, start: bool = True) -> bool:
        """True when the request is not to be scheduled now: its tier blocks are being read back into blocks it holds
        (started here when the hit has some, the worker copies them in and `start`: the scheduler would admit it),
        or have just arrived (look it up again). `wait`: nothing else would run this step, so wait for the read
        rather than step empty."""
        self._release_loaded()
        load = self.tier_loads.get(request.request_id)
        if load is None:
            if not (start and hit.tier_digests and self.tier is not None and self.tier.copy_in is not None):
                return False
            if len(hit.tier_digests) + sum(1 for b in hit.blocks if b.ref_count == 0) > self.pool.num_free_blocks:
                return False  # no room: allocate() finds none either
            load = self._start_load(request, hit)
        if wait or load.future.done():
            self._finish_load(load)
        return True

    def is_loading(self, request: Request) -> bool:
        return request.request_id in self.tier_loads

    def _start_load(self, request: Request, hit: PrefixHit) -> TierLoad:
        if request.status == RequestStatus.WAITING:  # counted once, with the hit it was admitted for
            self.record_prefix_query(request, hit)
            request.num_cached_prompt_tokens = hit.num_tokens
            request.status = RequestStatus.LOADING
        self.pool.take_cached(hit.blocks)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks += hit.blocks
        request.num_computed_tokens += len(hit.blocks) * self.block_size
        fresh = self.pool.take_new(len(hit.tier_digests))  # unregistered until they arrive: nobody else finds them
        blocks += fresh
        future = self.tier.start_load(hit.tier_digests, [b.block_id for b in fresh])
        load = self.tier_loads[request.request_id] = TierLoad(request, future, len(hit.blocks))
        return load

    def _finish_load(self, load: TierLoad) -> None:
        """The blocks that arrived count as computed and become findable (not written again); the ones after the
        first bad block stay the request's, to be computed."""
        request = load.request
        del self.tier_loads[request.request_id]
        try:
            arrived = load.future.result()
        except Exception:  # the reader was shut down under it: a miss, recomputed
            arrived = 0
        request.num_computed_tokens += arrived * self.block_size
        self._register_full_blocks(request, request.num_computed_tokens, load.first, arrived)

    def _release_loaded(self) -> None:
        """Blocks of requests that ended while their prefix was loading go back once the copy into them is over."""
        done = [(f, blocks) for f, blocks in self._release_after_load if f.done()]
        for entry in done:
            self._release_after_load.remove(entry)
            self.pool.release(entry[1][::-1])

    # ---- sliding window -------------------------------------------------------------------------------------
    def _num_out_of_window(self, request: Request) -> int:
        """Held blocks whose every token is older than the window: position p < computed - W is never read again
        (a query at q >= computed attends to keys > q - W)."""
        blocks = self.req_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return 0
        limit = min(len(blocks), max(0, request.num_computed_tokens - self.sliding_window) // self.block_size)
        return max(0, limit - self.req_first_live.get(request.request_id, 0))

    def _release_out_of_window(self, request: Request) -> None:
        count = self._num_out_of_window(request)
        if count == 0:
            return
        blocks = self.req_blocks[request.request_id]
        first = self.req_first_live.get(request.request_id, 0)
        self.pool.release(blocks[first : first + count])  # oldest first: evicted first, as in free()
        blocks[first : first + count] = [self.null_block] * count
        self.req_first_live[request.request_id] = first + count

    def max_live_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of num_tokens holds at once (scheduler reservations): all of them, or with a
        window the window's blocks plus one step's (a partial block at either end)."""
        full = cdiv(num_tokens, self.block_size)
        if self.sliding_window is None:
            return full
        return min(full, cdiv(self.sliding_window + max_step_tokens, self.block_size) + 1)

    def _live(self, request_id: str, blocks: list[KVBlock]) -> list[KVBlock]:
        return blocks[self.req_first_live.get(request_id, 0) :]

    def trim(self, request: Request) -> None:
        """Speculative rollback: return the blocks past the request's computed tokens (allocated for drafts that were
        rejected). Only unhashed blocks can be among them: hashes cover known tokens only."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if blocks is not None and len(blocks) > keep:
            self.pool.release(blocks[keep:][::-1])
            del blocks[keep:]

    def free(self, request: Request) -> None:
        """Return its blocks; the tail of the sequence is freed first so it is evicted first."""
        blocks = self._live(request.request_id, self.req_blocks.pop(request.request_id, []))
        self.req_first_live.pop(request.request_id, None)
        load = self.tier_loads.pop(request.request_id, None)
        if load is not None and not load.future.done():  # the reader may still be copying into them
            self._release_after_load.append((load.future, blocks))
        else:
            self.pool.release(blocks[::-1])
        self._release_loaded()
        self.req_keys.pop(request.request_id, None)
        if self.tier is not None:
            self.tier.forget(request.request_id)
        self.host_pool.release(self.req_host_blocks.pop(request.request_id, []))

    # ---- swap -----------------------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return self.num_blocks_of(request) <= self.host_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Park the request's blocks in host memory; its device blocks return to the pool."""
        first_live = self.req_first_live.get(request.request_id, 0)  # kept: the null entries come back on swap-in
        blocks = self.req_blocks.pop(request.request_id)[first_live:]
        host = self.host_pool.take(len(blocks))
        self.req_host_blocks[request.request_id] = host
        self.pool.release(blocks[::-1])
        return [(b.block_id, h) for b, h in zip(blocks, host)]

    def plan_swap_in(self, request: Request, num_new_tokens: int) -> SwapInPlan | None:
        host = self.req_host_blocks[request.request_id]
        first_live = self.req_first_live.get(request.request_id, 0)
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if total - first_live > self.pool.num_free_blocks:
            return None
        live = self.pool.take_new(total - first_live)
        blocks = [self.null_block] * first_live + live
        self.req_blocks[request.request_id] = blocks
        self.host_pool.release(self.req_host_blocks.pop(request.request_id))
        self._register_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return SwapInPlan([b.block_id for b in blocks], [(b.block_id, h) for b, h in zip(live, host)])

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.req_host_blocks

    # ---- accounting -------------------------------------------------------------------------------------------
    def blocks_of(self, request: Request) -> list[KVBlock]:
        """The request's blocks in table order (the manager's own list: read it, do not change it)."""
        return self.req_blocks.get(request.request_id, [])

    def num_blocks_of(self, request: Request) -> int:
        """Blocks it holds (a windowed request's null entries are not its own)."""
        blocks = self.blocks_of(request)
        return len(blocks) - self.req_first_live.get(request.request_id, 0) if blocks else 0

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.blocks_of(request)]


def _scores_prompt(request: Request) -> bool:
    """A request that asks for its prompt's logprobs computes every prompt position (a cached one has no logits);
    so does a pooling request (mean pooling reads every position's hidden state)."""
    params = request.sampling_params
    return (params.prompt_logprobs is not None or params.pooling is not None) and not request.output_token_ids
