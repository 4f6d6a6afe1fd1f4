"""`batchserve generate`: text for prompts given on the command line, through the offline API."""

from __future__ import annotations

import argparse
import json

from batchserve.config import ConfigError, EngineConfig
from batchserve.entrypoints.engine_args import ArgumentParser, add_engine_arguments, engine_config_from_args
from batchserve.entrypoints.llm import LLM
from batchserve.sampling_params import InvalidRequestError, SamplingParams

EXAMPLE_PROMPTS = ["What is continuous batching?", "Write a haiku about the sea.", "Name three planets."]


def build_generate_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="batchserve generate", description="Generate text with the default model.")
    parser.add_argument("prompts", nargs="*", help="prompts (chat-formatted unless --raw); default: a few examples")
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_arguments(parser, include_model=False)  # its --seed also seeds sampling
    return parser


def prepare(args: argparse.Namespace, prompts: list[str]) -> tuple[EngineConfig, SamplingParams]:
    """Everything checked before the model loads: sampling values, prompts, engine options. The KV pool is left to
    the offline LLM, which sizes it to the prompts once they are tokenized, unless an option sets it."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if not all(prompts):
        raise InvalidRequestError("a prompt is empty", "prompt")
    return engine_config_from_args(args, model=args.model), params


def main(argv: list[str]) -> int:
    parser = build_generate_parser()
    args = parser.parse_args(argv)
    prompts = args.prompts or EXAMPLE_PROMPTS
    try:
        config, params = prepare(args, prompts)
    except (ConfigError, InvalidRequestError) as exc:
        parser.error(str(exc))
    llm = LLM.from_config(config)  # sets torch's threads and seed
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
