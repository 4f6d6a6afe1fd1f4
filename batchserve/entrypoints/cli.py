"""`batchserve` command line: generate | serve | bench | tune."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from batchserve.entrypoints.engine_args import add_engine_arguments, engine_config_from_args

USAGE = """batchserve <command> [options]

commands:
  generate   generate text for prompts given on the command line (default model: SmolLM2-135M-Instruct)
  serve      start the OpenAI-compatible HTTP server
  bench      measure throughput and latency (offline or against any OpenAI-compatible server)
  tune       sweep scheduler settings against an SLO and print the best configuration
"""


def build_generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchserve generate", description="Generate text with the default model.")
    parser.add_argument("prompts", nargs="*", help="prompts (chat-formatted unless --raw); default: a few examples")
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_arguments(parser, include_model=False)  # its --seed also seeds sampling
    return parser


def generate_main(argv: list[str]) -> int:
    from batchserve.engine.llm_engine import LLMEngine
    from batchserve.entrypoints.llm import LLM
    from batchserve.sampling_params import SamplingParams

    args = build_generate_parser().parse_args(argv)
    prompts = args.prompts or ["What is continuous batching?", "Write a haiku about the sea.", "Name three planets."]
    config = engine_config_from_args(args, model=args.model)
    llm = LLM.from_engine(LLMEngine(config))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            ttft = out.metrics.first_token_time - out.metrics.arrival_time
            record = {"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason, "ttft_s": ttft}
            print(json.dumps(record | {"num_output_tokens": len(out.token_ids)}))
        else:
            print(f"### {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "generate":
        return generate_main(rest)
    if command == "serve":
        from batchserve.entrypoints.openai.api_server import main as serve_main

        return serve_main(rest) or 0
    if command == "bench":
        from batchserve.bench.cli import main as bench_main

        return bench_main(rest) or 0
    if command == "tune":
        from batchserve.bench.tune import main as tune_main

        return tune_main(rest) or 0
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
