"""`batchserve tune --simulate --kv-offload-blocks`: the disk tier's sizes searched on the simulator, each row with
its hit rate and TTFT. System prompts that do not fit the pool come back from a tier that holds them."""

from __future__ import annotations

import random

import pytest

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.workloads import BenchRequest
from batchserve.config import EngineConfig
from batchserve.simulator.profile_file import Profile
from batchserve.simulator.tune_sim import build_parser, format_rows, grid, search
from tests.simulator.helpers import STEP_MODEL

BLOCK = 16


def system_prompt_requests(prompts=8, rounds=5, prefix_blocks=4) -> list[BenchRequest]:
    """Round-robin over `prompts` system prompts of `prefix_blocks` blocks, each with a short question."""
    rng = random.Random(0)
    systems = [[p + 1] + [rng.randrange(3, 900) for _ in range(prefix_blocks * BLOCK - 1)] for p in range(prompts)]
    return [
        BenchRequest(f"{r}-{p}", systems[p] + [rng.randrange(3, 900) for _ in range(8)], 4)
        for r in range(rounds) for p in range(prompts)
    ]  # fmt: skip


def test_a_tier_that_holds_the_prompts_serves_them_and_cuts_ttft():
    args = build_parser().parse_args(
        ["--simulate", "--kv-offload-blocks", "0,8,1000", "--batch-sizes", "4", "--num-tokens", "512",
         "--policies", "max_utilization", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "1000"]
    )  # fmt: skip
    base = EngineConfig.from_options(num_kv_blocks=12, block_size=BLOCK)  # 12 blocks: about two prompts' prefixes
    profile = Profile("measured", STEP_MODEL, "tiny", "float32", 1024, 1024 * BLOCK * 512, 4096)
    requests = system_prompt_requests()
    rows = search(args, base, profile, requests, ArrivalProcess(max_concurrency=1))
    by_size = {r["config"]["kv_offload_blocks"]: r["summary"] for r in rows}
    assert sorted(by_size) == [0, 8, 1000]
    off, small, large = by_size[0], by_size[8], by_size[1000]
    assert off["kv_tier"]["hit_blocks"] == 0
    # every round after the first finds all 4 blocks of each system prompt in the large tier: 4 of 5 rounds' blocks
    assert large["kv_tier"]["hit_rate"] == pytest.approx(4 * 8 * 4 / (5 * 8 * 4))
    assert small["kv_tier"]["hit_rate"] < large["kv_tier"]["hit_rate"]  # 8 blocks: LRU evicts before the turn comes
    assert large["ttft_ms"]["p50"] < off["ttft_ms"]["p50"]
    table = format_rows(rows)
    assert "tier hit %" in table and "TTFT p50" in table


def test_bad_tier_sizes_are_refused_naming_the_flag():
    for argv, flag in ((["--kv-offload-blocks", "-1"], "--kv-offload-blocks"),
                       (["--kv-offload-read-gbps", "0"], "--kv-offload-read-gbps")):  # fmt: skip
        with pytest.raises(ValueError, match=flag):
            grid(build_parser().parse_args(["--simulate", *argv]))
