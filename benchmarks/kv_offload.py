"""The disk KV tier (docs/kv-offload.md), tier on vs off, on the default model (or --model):

1. multi-turn chat: C conversations x T turns, each turn's prompt the whole history so far plus a new user message,
   the conversations taking turns round-robin, over a KV pool that holds about a quarter of all histories: TTFT p50
   of the turns after the first, tier on vs off;
2. a block read back (read, checked, copied into the pool) vs recomputing its tokens (prefill time per token x block);
3. restart: a second engine on the same directory resumes each conversation: share of its full prompt blocks served
   by the tier;
4. nothing hits: unique prompts, throughput with the tier on (writing every block) vs off, alternating rounds.

    .venv/bin/python benchmarks/kv_offload.py [--conversations 8] [--turns 4] [--model PATH]

Token ids stand in for chat text (a template changes nothing the tier sees). Scaled down by default to stay under
about three minutes on two cores; the full-sized shape is --conversations 48 --turns 6 --system 400 --user 250
(--conversations 4 with --rounds 0 keeps its turn sizes and runs in minutes); --clock cpu --threads 1 on a loaded host.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve.engine.llm_engine import LLMEngine  # noqa: E402
from batchserve.host.process import configure_torch  # noqa: E402
from batchserve.layers import kernels  # noqa: E402
from batchserve.sampling_params import SamplingParams  # noqa: E402

BLOCK = 16


def make_engine(args, tier_dir: str | None, num_blocks: int) -> LLMEngine:
    options = dict(model=args.model, device="cpu", dtype=args.dtype, block_size=BLOCK, num_kv_blocks=num_blocks,
                   max_batch_size=16, max_num_tokens=2048, num_threads=args.threads)  # fmt: skip
    if tier_dir is not None:
        options["kv_offload_dir"] = tier_dir
    return LLMEngine.from_options(**{k: v for k, v in options.items() if v is not None})


def serve_one(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(TTFT seconds, output ids) of one request served alone; counts its prompt tokens computed in COMPUTED."""
    start = CLOCK[0]()
    engine.add_prompt(None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ttft, out = None, []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.delta_token_ids and ttft is None:
                ttft = CLOCK[0]() - start
                COMPUTED[id(engine)] = COMPUTED.get(id(engine), []) + [len(prompt) - delta.metrics.num_cached_tokens]
            out += delta.delta_token_ids
    return ttft, out


COMPUTED: dict[int, list[int]] = {}  # prompt tokens each engine computed (not found in the pool or the tier), per turn


def chat(engines: dict[str, LLMEngine], args, rng_seed: int = 0) -> tuple[list[list[int]], dict[str, list[float]]]:
    """Round-robin turns, each request served by every engine in turn (lockstep, so that a busy host slows both
    alike); returns the histories and each engine's TTFTs of the turns after the first."""
    rng = random.Random(rng_seed)
    vocab = next(iter(engines.values())).model_config.vocab_size
    histories = [[rng.randrange(10, vocab) for _ in range(args.system)] for _ in range(args.conversations)]
    later: dict[str, list[float]] = {name: [] for name in engines}
    for turn in range(args.turns):
        for history in histories:
            history += [rng.randrange(10, vocab) for _ in range(args.user)]
            outs = []
            for name, engine in engines.items() if turn % 2 else reversed(engines.items()):
                ttft, out = serve_one(engine, history, args.reply)
                outs.append(out)
                if turn:
                    later[name].append(ttft)
            if any(o != outs[0] for o in outs):
                # float32 must agree; in bfloat16 a prefix read back (or cached) is attended as a chunk after its
                # context while the recompute prefills it whole, and the two round differently at a near-tie
                assert args.dtype != "float32", "the tier changed the tokens"
                DIFFERING.append(len(history))
            history += outs[0]
    return histories, later


DIFFERING: list[int] = []  # bfloat16: turns whose replies differed with the tier on (their history's length)


def throughput(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = CLOCK[0]()
    for prompt in prompts:
        engine.add_prompt(None, prompt, params)
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(d.delta_token_ids) for d in engine.step())
    if getattr(engine.runner, "offload", None) is not None:
        # every write of this round counted in this round (none left to run during the other engine's round): on
        # the wall clock a little pessimistic, as a steady load would overlap the last writes with later steps
        engine.runner.offload.flush()
    return produced / (CLOCK[0]() - start)


# --clock cpu: the process's CPU seconds (every thread's: the tier's reader and writer included) instead of wall
# seconds, a measure that a host loaded by others disturbs far less (with --threads 1: no thread waits for another)
CLOCK = [time.perf_counter]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=160, help="tokens of each conversation's opening")
    parser.add_argument("--user", type=int, default=120, help="tokens of each new user message")
    parser.add_argument("--reply", type=int, default=8, help="tokens generated a turn")
    parser.add_argument("--unique", type=int, default=12, help="requests of the nothing-hits throughput rounds")
    parser.add_argument("--rounds", type=int, default=2, help="nothing-hits throughput rounds (0: skip them)")
    parser.add_argument("--throughput-only", action="store_true", help="only the nothing-hits rounds")
    parser.add_argument("--unique-len", type=int, default=256, help="tokens of each unique prompt")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: TTFT and throughput in the process's CPU seconds (for a host others load; use with --threads 1)",
    )
    args = parser.parse_args()
    # an entry point's settings (an engine never makes them): without this --threads never reached torch, and freed
    # activations went back to the kernel after each step, as they do in no server
    configure_torch(args.threads, 0)
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    flags = kernels.cpu_flags().split()
    bf16 = "yes" if "avx512_bf16" in flags or "amx_bf16" in flags else "no"
    final = args.system + args.turns * (args.user + args.reply)
    all_blocks = args.conversations * -(-final // BLOCK)
    pool = max(-(-(final + args.user) // BLOCK) + 2, all_blocks // 4)  # a resumed conversation fits alone
    began = time.perf_counter()
    print(f"[bf16 matmul units: {bf16}] {args.dtype}, {args.clock} clock; {args.conversations} conversations x {args.turns} turns, "
          f"histories to {final} tokens; pool {pool} blocks (~1/4 of {all_blocks})")  # fmt: skip

    if not args.throughput_only:
        chat_phases(args, pool)
    if args.rounds:
        nothing_hits(args)
    print(f"({time.perf_counter() - began:.0f} s in all)")


def chat_phases(args, pool: int) -> None:
    with tempfile.TemporaryDirectory() as tier_dir:
        off, on = make_engine(args, None, pool), make_engine(args, tier_dir, pool)
        for engine in (off, on):
            serve_one(engine, list(range(10, 60)), 2)  # warm-up
        loads = time_loads(on)
        histories, later = chat({"off": off, "on": on}, args)
        on.runner.offload.flush()
        p50_off, p50_on = statistics.median(later["off"]), statistics.median(later["on"])
        same = "same tokens" if not DIFFERING else f"{len(DIFFERING)} replies differed (bf16 near-ties)"
        print(f"TTFT p50, turns 2..{args.turns}: off {p50_off * 1e3:.1f} ms, on {p50_on * 1e3:.1f} ms "
              f"({p50_off / p50_on:.2f}x); {same}")  # fmt: skip
        turns = args.conversations * (args.turns - 1)  # the later turns: each engine's last `turns` requests
        computed = {name: statistics.median(COMPUTED[id(e)][-turns:]) for name, e in (("off", off), ("on", on))}
        print(f"prompt tokens computed per later turn (p50): off {computed['off']:.0f}, on {computed['on']:.0f} "
              f"(the rest found in the pool or the tier)")  # fmt: skip

        stats = on.kv_tier.stats
        read_block = stats.read_s / max(stats.blocks_read, 1)
        longest = max(histories, key=len)
        ttft, _ = serve_one(off, [5] + longest[: (len(longest) // BLOCK) * BLOCK], 1)  # nothing cached: all computed
        per_block = ttft / (len(longest) // BLOCK)
        load_block = loads[0] / loads[1] if loads[1] else read_block
        print(f"a block: read + check {read_block * 1e3:.2f} ms, + copied into the pool {load_block * 1e3:.2f} ms, "
              f"vs recompute {per_block * 1e3:.2f} ms ({per_block / load_block:.1f}x); {stats.blocks_read} blocks "
              f"read, {stats.blocks_written} written, {stats.bytes_written / 2**20:.0f} MiB")  # fmt: skip
        on.close()
        off.close()

        restarted = make_engine(args, tier_dir, pool)
        rng = random.Random(1)
        full, served = 0, 0
        for history in histories:
            prompt = history + [rng.randrange(10, restarted.model_config.vocab_size) for _ in range(args.user)]
            before = restarted.kv_tier.stats.hits
            serve_one(restarted, prompt, 1)
            full += (len(history) - 1) // BLOCK  # its last token was sampled, never computed: no K/V
            served += restarted.kv_tier.stats.hits - before
        print(f"restart: the first turn of each resumed conversation found {served / full:.0%} of its history's "
              f"full blocks in the tier ({served}/{full})")  # fmt: skip
        restarted.close()


def time_loads(engine: LLMEngine) -> list[float]:
    """[seconds, blocks] of the tier's block loads (read, check, into the pool: by the reader thread, or by the
    scheduler's thread helping it), each block's time summed, whichever thread took it."""
    totals, lock = [0.0, 0], threading.Lock()
    real = getattr(engine.kv_tier, "_load_one", None)
    if real is None:  # a checkout from before the per-block load jobs
        return totals

    clock = time.thread_time if CLOCK[0] is time.process_time else time.perf_counter  # on the thread that loads

    def timed(*args):
        start = clock()
        arrived = real(*args)
        with lock:
            totals[0] += clock() - start
            totals[1] += int(arrived)
        return arrived

    engine.kv_tier._load_one = timed
    return totals


def nothing_hits(args) -> None:
    with tempfile.TemporaryDirectory() as tier_dir:
        engines = {"off": make_engine(args, None, 512), "on": make_engine(args, tier_dir, 512)}
        rng = random.Random(2)
        rates = {name: [] for name in engines}
        for engine in engines.values():
            throughput(engine, [list(range(10, 40))], 2)  # warm-up
        for _ in range(args.rounds):
            for name, engine in engines.items():
                prompts = [[rng.randrange(10, 20000) for _ in range(args.unique_len)] for _ in range(args.unique)]
                rates[name].append(throughput(engine, prompts, 16))
        best = {name: max(r) for name, r in rates.items()}
        print(
            f"nothing hits, {args.unique} unique {args.unique_len}-token prompts x 16 tokens: off {best['off']:.0f} tok/s, on "
            f"{best['on']:.0f} tok/s ({best['on'] / best['off']:.3f}x; best of {args.rounds} alternating rounds)"
        )
        on = engines["on"]
        print(f"  ratios by round: {' '.join(f'{a / b:.3f}' for a, b in zip(rates['on'], rates['off']))}; tier on: "
              f"{on.kv_tier.stats.blocks_written} blocks written, {on.runner.offload.num_skipped} saves skipped"
              f"{skipped_why(on.kv_tier)}")  # fmt: skip
        for engine in engines.values():
            engine.close()


def skipped_why(tier) -> str:
    holds = getattr(tier, "writer_holds", None)  # a checkout from before the writer read the pool has none
    if holds is None:
        return ""
    return f" ({holds.num_over_budget} past the writer's budget, {holds.num_reused_first} reused by the pool first)"


if __name__ == "__main__":
    main()
