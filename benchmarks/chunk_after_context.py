"""What a prefix hit leaves to compute: prefilling N new tokens after C cached ones (the context found in the pool, as
a prefix-cache or disk-tier hit finds it) against prefilling N fresh tokens and against all C + N fresh, in the
process's CPU seconds on one thread (which a host loaded by others disturbs far less than wall time).

    .venv/bin/python benchmarks/chunk_after_context.py [--dtype bfloat16] [--context 512] [--new 138] [--reps 7]

A hit costs what it should when (after - fresh N) is about the attention of N queries over the C cached keys, and
after / fresh C+N is near the share of the linear layers that N tokens take.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve.engine.llm_engine import LLMEngine  # noqa: E402
from batchserve.host.process import configure_torch  # noqa: E402
from batchserve.layers import kernels  # noqa: E402
from batchserve.sampling_params import SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prefill_cpu_s(engine: LLMEngine, prompt: list[int]) -> float:
    """CPU seconds to serve `prompt` to its first token (what the pool already holds of it is not computed)."""
    start = time.process_time()
    engine.add_prompt(None, prompt, ONE_TOKEN)
    while engine.has_unfinished_requests():
        engine.step()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=512, help="cached tokens before the chunk")
    parser.add_argument("--new", type=int, default=138, help="tokens of the chunk")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    configure_torch(args.threads, 0)
    options = dict(model=args.model, device="cpu", dtype=args.dtype, block_size=16, num_kv_blocks=1024,
                   max_batch_size=16, max_num_tokens=4096)  # fmt: skip
    engine = LLMEngine.from_options(**{k: v for k, v in options.items() if v is not None})
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prefill_cpu_s(engine, tokens(50))  # warm-up
    total = args.context + args.new
    times: dict[str, list[float]] = {"all fresh": [], "N fresh": [], "N after C cached": []}
    for _ in range(args.reps):  # interleaved, so that a drifting host moves the three alike
        times["all fresh"].append(prefill_cpu_s(engine, tokens(total)))
        times["N fresh"].append(prefill_cpu_s(engine, tokens(args.new)))
        prompt = tokens(total)
        prefill_cpu_s(engine, prompt[: args.context])  # its full blocks stay in the pool
        times["N after C cached"].append(prefill_cpu_s(engine, prompt))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    flags = kernels.cpu_flags().split()
    bf16 = "yes" if "avx512_bf16" in flags or "amx_bf16" in flags else "no"
    print(f"[bf16 matmul units: {bf16}] {args.dtype}, {args.threads} thread(s), CPU ms, median of {args.reps}: "
          f"{total} fresh {ms['all fresh']:.1f}; {args.new} fresh {ms['N fresh']:.1f}; {args.new} after "
          f"{args.context} cached {ms['N after C cached']:.1f} ({ms['N after C cached'] / ms['all fresh']:.3f}x of "
          f"all fresh; the context adds {ms['N after C cached'] - ms['N fresh']:.1f})")  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
