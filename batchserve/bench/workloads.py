"""Benchmark workloads: lists of requests with exact prompt and output lengths, reproducible from a seed.

Prompts are real prose (bench/corpus.py) cut to the wanted number of tokens with the model's tokenizer; any object with
`encode(text) -> list[int]` and `decode(ids) -> str` will do, so tests can pass a trivial one. Every request carries
`ignore_eos` semantics: the runner asks for exactly `output_len` tokens.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from batchserve.bench.corpus import CORPUS
from batchserve.bench.repetitive import DEFAULT_OUTPUT_LEN, REPETITIVE_WORKLOADS, conversations, prompt_ids

WORKLOADS = ("mixed", "uniform", "longtail", "shared-prefix", "sharegpt", *REPETITIVE_WORKLOADS)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int  # max_tokens, with ignore_eos: exactly what the server generates
    category: str = ""
    prompt_text: str | None = None  # the text the ids came from (sharegpt) or decode(ids)
    ignore_eos: bool = True  # generate output_len tokens whatever the model says (bench --no-ignore-eos: stop at EOS)
    ttft_slo_ms: float | None = None  # the request's own targets, sent with it (None: the server's, if any)
    tpot_slo_ms: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class WorkloadOptions:
    """Knobs of the synthetic workloads; None picks the workload's own default (see DEFAULTS)."""

    input_len: int | None = None
    output_len: int | None = None
    spread: float = 0.2  # uniform: output lengths in output_len * [1 - spread, 1 + spread]
    long_ratio: float = 0.2  # mixed: share of long summarisation requests
    long_input_len: int = 2000
    long_output_len: int = 500
    sigma: float = 0.8  # longtail: sigma of the log-normal output length (median = output_len)
    max_output_len: int = 2048  # longtail / sharegpt: clip
    prefix_len: int = 512  # shared-prefix: the common system prompt
    num_prefixes: int = 1  # shared-prefix: distinct system prompts, users spread evenly over them in random order
    dataset: str | None = None  # sharegpt: path of the JSON file
    extra: dict[str, Any] = field(default_factory=dict)


DEFAULTS = {  # (input_len, output_len)
    "mixed": (50, 100),  # the short Q&A half; long ones use long_input_len / long_output_len
    "uniform": (128, 100),
    "longtail": (128, 100),
    "shared-prefix": (64, 100),
    "sharegpt": (None, None),
}


def encode(tokenizer: Any, text: str) -> list[int]:
    """encode without special tokens where the tokenizer supports the flag (HF), else plainly."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


class PromptMaker:
    """Cuts prompts of an exact token length out of the corpus, starting at a random place and wrapping around.

    Each prompt opens with a short unique header so that unrelated prompts never share a prefix-cache block.
    """

    def __init__(self, tokenizer: Any, corpus: str = CORPUS) -> None:
        self.tokenizer = tokenizer
        self.ids = encode(tokenizer, " ".join(corpus.split()))
        if not self.ids:
            raise ValueError("the tokenizer turned the corpus into no tokens")

    def text_ids(self, n: int, rng: random.Random) -> list[int]:
        start = rng.randrange(len(self.ids))
        reps = (start + n) // len(self.ids) + 1
        return (self.ids * reps)[start : start + n] if n > 0 else []

    def prompt(self, n: int, rng: random.Random, tag: str) -> list[int]:
        header = encode(self.tokenizer, f"[{tag}] ")[:n]
        return header + self.text_ids(n - len(header), rng)


def _request(i: int, ids: list[int], out: int, category: str) -> BenchRequest:
    return BenchRequest(f"req-{i}", ids, max(1, int(out)), category)


def uniform(tok: Any, n: int, rng: random.Random, opt: WorkloadOptions, seed: int) -> list[BenchRequest]:
    maker, (inp, out) = PromptMaker(tok), _lens("uniform", opt)
    lo, hi = round(out * (1 - opt.spread)), round(out * (1 + opt.spread))
    return [_request(i, maker.prompt(inp, rng, f"{seed}-{i}"), rng.randint(lo, hi), "uniform") for i in range(n)]


def mixed(tok: Any, n: int, rng: random.Random, opt: WorkloadOptions, seed: int) -> list[BenchRequest]:
    maker, (inp, out) = PromptMaker(tok), _lens("mixed", opt)
    num_long = round(n * opt.long_ratio)
    kinds = ["long"] * num_long + ["short"] * (n - num_long)
    rng.shuffle(kinds)
    reqs = []
    for i, kind in enumerate(kinds):
        if kind == "long":
            ids, o = maker.prompt(opt.long_input_len, rng, f"{seed}-{i}"), opt.long_output_len
        else:
            ids, o = maker.prompt(inp, rng, f"{seed}-{i}"), out
        reqs.append(_request(i, ids, o, kind))
    return reqs


def longtail(tok: Any, n: int, rng: random.Random, opt: WorkloadOptions, seed: int) -> list[BenchRequest]:
    maker, (inp, out) = PromptMaker(tok), _lens("longtail", opt)
    reqs = []
    for i in range(n):
        o = min(opt.max_output_len, max(1, round(rng.lognormvariate(math.log(out), opt.sigma))))
        reqs.append(_request(i, maker.prompt(inp, rng, f"{seed}-{i}"), o, "longtail"))
    return reqs


def shared_prefix(tok: Any, n: int, rng: random.Random, opt: WorkloadOptions, seed: int) -> list[BenchRequest]:
    """`num_prefixes` system prompts of `prefix_len` tokens, each opening with its own number (no two share a
    block), each followed by a user's short question; request i uses system prompt i % num_prefixes, arrivals in
    random order."""
    if opt.num_prefixes < 1:
        raise ValueError("num_prefixes must be >= 1")
    maker, (inp, out) = PromptMaker(tok), _lens("shared-prefix", opt)
    systems = []
    for k in range(opt.num_prefixes):
        opening = "You are a helpful assistant. Read the passage and answer briefly. "
        if opt.num_prefixes > 1:
            opening = f"[system {k}] " + opening
        system = encode(tok, opening)[: opt.prefix_len]
        systems.append(system + maker.text_ids(opt.prefix_len - len(system), rng))
    groups = [i % opt.num_prefixes for i in range(n)]
    if opt.num_prefixes > 1:
        rng.shuffle(groups)
    return [
        _request(i, systems[g] + maker.prompt(inp, rng, f"{seed}-{i}"), out, "shared-prefix")
        for i, g in enumerate(groups)
    ]


def sharegpt(tok: Any, n: int, rng: random.Random, opt: WorkloadOptions, seed: int) -> list[BenchRequest]:
    """First human turn as the prompt, the length of the first reply as output_len (as vLLM's benchmark does)."""
    if not opt.dataset:
        raise ValueError("the sharegpt workload needs --dataset FILE.json")
    data = json.loads(Path(opt.dataset).read_text())
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2:
            pairs.append((turns[0].get("value", ""), turns[1].get("value", "")))
    rng.shuffle(pairs)
    reqs: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(reqs) == n:
            break
        ids, out = encode(tok, prompt), len(encode(tok, reply))
        max_in = opt.input_len or 4096
        if len(ids) < 4 or out < 4 or len(ids) > max_in or out > opt.max_output_len:
            continue
        reqs.append(BenchRequest(f"req-{len(reqs)}", ids, out, "sharegpt", prompt))
    if len(reqs) < n:
        raise ValueError(f"{opt.dataset}: only {len(reqs)} usable conversations, {n} wanted")
    return reqs


_GENERATORS = {
    "uniform": uniform,
    "mixed": mixed,
    "longtail": longtail,
    "shared-prefix": shared_prefix,
    "sharegpt": sharegpt,
}


def repetitive(name: str, tok: Any, n: int, opt: WorkloadOptions) -> list[BenchRequest]:
    """Chat requests whose answers repeat their prompts (bench/repetitive.py), each stopping at its end of sequence
    or after output_len tokens."""
    cap = opt.output_len or DEFAULT_OUTPUT_LEN
    return [
        BenchRequest(f"req-{i}", prompt_ids(tok, conv), cap, name, conv[-1]["content"], ignore_eos=False)
        for i, conv in enumerate(conversations(name, n))
    ]


def _lens(name: str, opt: WorkloadOptions) -> tuple[int, int]:
    inp, out = DEFAULTS[name]
    return (opt.input_len or inp, opt.output_len or out)


def make_workload(
    name: str, tokenizer: Any, num_requests: int, seed: int = 0, options: WorkloadOptions | None = None
) -> list[BenchRequest]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    if name in REPETITIVE_WORKLOADS:
        return repetitive(name, tokenizer, num_requests, options or WorkloadOptions())
    return _GENERATORS[name](tokenizer, num_requests, random.Random(seed), options or WorkloadOptions(), seed)


def describe(requests: list[BenchRequest]) -> dict[str, float]:
    ins = [r.prompt_len for r in requests]
    outs = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "mean_input_len": sum(ins) / len(ins),
        "mean_output_len": sum(outs) / len(outs),
        "min_output_len": min(outs),
        "max_output_len": max(outs),
        "total_input_tokens": sum(ins),
        "total_output_tokens": sum(outs),
    }
