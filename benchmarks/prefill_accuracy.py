"""How far bf16 prefill attention puts the default model's logits from float32's, per prefill attention method: every
prompt position of --prompts paragraphs of docs/ (the first --tokens tokens of each, so that under "split" every chunk
takes the native kernel), scored in float32 and in bfloat16 once per method (--methods), each engine in this process.

Prints, per method, over all positions: the mean distance of float32's top token's logit (and its mean, signed), the
99th percentile, and how many positions' greedy token differs from float32's (and how many of those where float32's
top two are more than --gap apart: not a tie). The README question's first reply token is reported on its own (a
near-tie, 0.08 in float32: docs/cpu-kernels.md, prefill attention by chunk length).

    .venv/bin/python benchmarks/prefill_accuracy.py [--prompts 40] [--tokens 120] [--methods sdpa,split]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from batchserve import LLM, SamplingParams

DOCS = Path(__file__).resolve().parent.parent / "docs"
README_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def paragraphs(count: int) -> list[str]:
    """Prose paragraphs of the docs (no tables, code or lists), shuffled with a fixed seed."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for block in page.read_text().split("\n\n"):
            text = " ".join(block.split())
            if len(text) > 200 and not text.startswith(("|", "```", "#", "-", "<")):
                found.append(text[:600])
    random.Random(0).shuffle(found)
    return found[:count]


def position_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits at every prompt position ([positions, vocab], float32): prompt_logprobs makes the runner score them."""
    model, captured = llm.engine.runner.model, []
    inner = model.compute_logits

    def keep(hidden: torch.Tensor) -> torch.Tensor:
        out = inner(hidden)
        captured.append(out.float())
        return out

    model.compute_logits = keep
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    try:
        for ids in prompts:  # one at a time: the captured rows stay in prompt order
            llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        readme = llm.chat(README_CHAT, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        assert readme
        return torch.cat(captured)
    finally:
        model.compute_logits = inner


def report(name: str, got: torch.Tensor, ref: torch.Tensor, gap: float) -> None:
    top2 = ref.topk(2, dim=1)
    clear = top2.values[:, 0] - top2.values[:, 1] > gap
    top = top2.indices[:, 0]
    d = (got - ref).gather(1, top[:, None])[:, 0]
    flips = got.argmax(1) != top
    readme = d[-1]  # the README question's first reply token: the last row scored
    print(
        f"{name:>8}: mean |d| {d.abs().mean():.4f} (signed {d.mean():+.4f}), p99 {d.abs().quantile(0.99):.3f}; "
        f"greedy token differs at {int(flips.sum())} of {len(d)} ({int((flips & clear).sum())} not ties); "
        f"README first token {readme:+.3f} ({'differs' if flips[-1] else 'same'})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--methods", default="sdpa,split")
    ap.add_argument("--gap", type=float, default=0.05)
    args = ap.parse_args()
    options = dict(device="cpu", max_batch_size=8, quantization="none", num_kv_blocks=64)
    reference = LLM(dtype="float32", **options)
    prompts = [reference.tokenizer(text)["input_ids"][: args.tokens] for text in paragraphs(args.prompts)]
    ref = position_logits(reference, prompts)
    del reference
    print(f"default model, {len(prompts)} prompts, {ref.shape[0]} positions; bf16 against float32")
    for method in args.methods.split(","):
        llm = LLM(dtype="bfloat16", prefill_attention=method, **options)
        report(method, position_logits(llm, prompts), ref, args.gap)
        del llm


if __name__ == "__main__":
    main()
