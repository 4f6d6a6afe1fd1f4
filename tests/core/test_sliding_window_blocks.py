"""Sliding-window KV blocks (core/kv_cache_manager.py): a request on a model whose every layer is windowed returns
the blocks that left its window to the pool while it runs, keeps the null block in their table entries, and prefix
hits stop where content is gone."""

from __future__ import annotations

from batchserve.config import CacheConfig, SchedulerConfig
from batchserve.core.block_pool import BlockPool, HostBlockPool
from batchserve.core.build import build_scheduler
from batchserve.core.kv_cache_manager import KVCacheManager
from tests.core.helpers import make_request

BLOCK_SIZE = 4
WINDOW = 16  # tokens: 4 blocks


def manager(num_blocks=64, caching=True, host_blocks=0, window=WINDOW) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching), BLOCK_SIZE, HostBlockPool(host_blocks), window)


def run(kv: KVCacheManager, request, chunk: int, until: int, on_step=None) -> list[int]:
    """Allocate and 'compute' like the scheduler does (chunked prefill, then one token a step) up to `until`
    tokens; returns the blocks held after each step."""
    held = []
    while request.num_computed_tokens < until:
        if request.num_computed_tokens >= request.num_prompt_tokens:
            request.output_token_ids.append(7)
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate(request, n) is not None
        request.num_computed_tokens += n
        held.append(kv.num_blocks_of(request))
        if on_step:
            on_step()
    return held


def live_blocks(kv, request):
    return [b for b in kv.blocks_of(request) if b is not kv.null_block]


def test_a_request_of_four_windows_holds_the_window_and_the_pool_gets_the_rest():
    kv = manager()
    pool = kv.pool
    free_at_start = pool.num_free_blocks
    request = make_request("long", prompt=list(range(1, 4 * WINDOW + 1)), max_tokens=4 * WINDOW)
    held = run(kv, request, chunk=BLOCK_SIZE, until=8 * WINDOW)
    assert max(held) <= WINDOW // BLOCK_SIZE + 2
    table = kv.blocks_of(request)
    assert len(table) == 8 * WINDOW // BLOCK_SIZE  # every position still indexes its entry
    assert table[0] is kv.null_block and table[-1] is not kv.null_block
    assert pool.num_free_blocks == free_at_start - kv.num_blocks_of(request)  # the rest went back
    # what is held covers at least the window the next query sees (positions > computed - W)
    first_live = len(table) - kv.num_blocks_of(request)
    assert first_live * BLOCK_SIZE <= request.num_computed_tokens - WINDOW + 1
    kv.free(request)
    assert pool.num_free_blocks == free_at_start and pool.null_block.ref_count == 1


def test_without_a_window_every_block_is_kept():
    kv = manager(window=None)
    request = make_request("long", prompt=list(range(1, 4 * WINDOW + 1)), max_tokens=8)
    held = run(kv, request, chunk=BLOCK_SIZE, until=4 * WINDOW)
    assert held[-1] == 4 * WINDOW // BLOCK_SIZE and kv.null_block is None


def test_a_long_prefill_chunk_frees_its_predecessors_at_the_next_step():
    kv = manager()
    request = make_request("chunky", prompt=list(range(1, 5 * WINDOW + 1)), max_tokens=1)
    held = run(kv, request, chunk=2 * WINDOW, until=4 * WINDOW)
    assert held == [8, 12]  # 2W after the first chunk; then the W oldest tokens (4 blocks) left, 2W more came
    # the bound for one step's tokens: the window's blocks plus the step's, a partial block at either end
    assert max(held) <= kv.max_live_blocks(10**6, 2 * WINDOW)


def test_the_blocks_that_left_are_evicted_first_and_hits_stop_at_the_first_gone():
    kv = manager(num_blocks=20)
    prompt = list(range(1, 4 * WINDOW + 1))
    first = make_request("a", prompt=prompt, max_tokens=1)
    run(kv, first, chunk=BLOCK_SIZE, until=len(prompt))
    # the released blocks are still cached (their content is valid until reused): a same-prompt request hits them
    same = make_request("b", prompt=prompt, max_tokens=1)
    hit = kv.find_prefix_hit(same)
    assert hit.num_tokens == len(prompt) - BLOCK_SIZE  # all full blocks but the last (one token left to compute)
    # other requests take every free block: the released ones are evicted; the live tail stays cached, but a hit
    # needs the chain from the first block, so it stops at the first gone
    taken = kv.pool.take_new(kv.pool.num_free_blocks)
    tail = kv.blocks_of(first)[-2]
    assert tail is not kv.null_block and kv.pool.lookup(tail.key) is tail
    assert kv.find_prefix_hit(same).num_tokens == 0
    kv.pool.release(taken)
    kv.free(first)


def test_a_hit_longer_than_the_window_takes_its_tail_only():
    kv = manager()
    prompt = list(range(1, 4 * WINDOW + 2))
    first = make_request("a", prompt=prompt, max_tokens=1)
    run(kv, first, chunk=WINDOW, until=len(prompt))
    kv.free(first)
    again = make_request("b", prompt=prompt, max_tokens=1)
    hit = kv.find_prefix_hit(again)
    assert hit.num_tokens == 4 * WINDOW
    blocks = kv.allocate(again, again.num_tokens - hit.num_tokens, hit)
    assert len(blocks) == len(prompt) // BLOCK_SIZE + 1  # the table's entries, the released ones as the null block
    assert blocks.count(kv.null_block.block_id) == kv.blocks_of(again).count(kv.null_block)
    assert kv.num_blocks_of(again) <= WINDOW // BLOCK_SIZE + 2


def test_swap_out_and_in_keeps_the_table_shape_and_moves_only_live_blocks():
    kv = manager(host_blocks=16)
    request = make_request("s", prompt=list(range(1, 3 * WINDOW + 1)), max_tokens=4)
    run(kv, request, chunk=BLOCK_SIZE, until=3 * WINDOW)
    live = kv.num_blocks_of(request)
    table_len = len(kv.blocks_of(request))
    pairs = kv.swap_out(request)
    assert len(pairs) == live and kv.pool.num_free_blocks == kv.pool.num_blocks - 1
    plan = kv.plan_swap_in(request, 1)
    assert len(plan.pairs) == live and len(plan.new_block_ids) == table_len + 1
    assert kv.num_blocks_of(request) == live + 1
    kv.free(request)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1


def test_accounting_counts_only_live_blocks():
    kv = manager()
    request = make_request("x", prompt=list(range(1, 4 * WINDOW + 1)), max_tokens=8)
    run(kv, request, chunk=BLOCK_SIZE, until=4 * WINDOW)
    owners: dict[int, int] = {}
    for b in live_blocks(kv, request):
        owners[b.block_id] = owners.get(b.block_id, 0) + 1
    for b in kv.pool.blocks:
        if b is not kv.null_block:
            assert b.ref_count == owners.get(b.block_id, 0)
    # the next decode needs at most one new block, less the one that leaves the window
    request.output_token_ids.append(7)
    assert kv.blocks_needed(request, 1) <= 1
    assert kv.max_live_blocks(4 * WINDOW, 1) == WINDOW // BLOCK_SIZE + 2
    assert manager(window=None).max_live_blocks(4 * WINDOW, 1) == 4 * WINDOW // BLOCK_SIZE


def test_guaranteed_no_evict_reserves_the_window_not_the_length():
    def admitted(window):
        config = SchedulerConfig(scheduler_policy="guaranteed_no_evict", max_num_tokens=16, max_batch_size=4)
        s = build_scheduler(config, CacheConfig(block_size=BLOCK_SIZE), 17, sliding_window=window)
        for i in range(2):
            s.add_request(make_request(f"r{i}", prompt_len=8, max_tokens=42))
        s.schedule()
        return len(s.running)

    # 50 tokens: 13 blocks each, two do not fit in 16; with W=8 each holds at most cdiv(8 + 16, 4) + 1 = 7
    assert admitted(None) == 1
    assert admitted(8) == 2
