"""The GPU check of issue 6 as one prepared script: greedy parity with transformers on the device, decode tok/s at
batch 1 / 64 / 256, and the TTFT of a 2048-token prompt. It runs on CPU too (a smoke test of the script itself).

    python3 benchmarks/gpu_check.py --out "$OUT"                                 # on a lent GPU (cuda, defaults)
    .venv/bin/python benchmarks/gpu_check.py --device cpu --batch-sizes 1,4 --ttft-len 128 \\
        --parity-requests 2 --new-tokens 8 --decode-steps 3                       # smoke test here

Weights: `--model PATH` (an HF directory or a GGUF file) or, by default, SmolLM2-135M-Instruct's exact shapes with
seeded random weights saved as an HF checkpoint in a temporary folder: the device machine cannot download, and the
packaged GGUF (98 MB) is over what a device call carries. Timings depend only on the shapes. The random weights are
drawn at a large scale (like the tests' tiny models) so that greedy decoding has decisive logits and no near-ties.

Parity runs in float32 with TF32 off: every request's greedy tokens from batchserve (all requests batched together)
against transformers' `generate` (one request at a time) on the same device. Timings run in `--dtype`.
One JSON result goes to --out (default bench_results/).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from roofline import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VOCAB  # SmolLM2-135M's shapes

SMOLLM2_135M = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=INTERMEDIATE,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def random_checkpoint(directory: Path, seed: int = 0) -> Path:
    """SmolLM2-135M's shapes, random weights, and a word-level tokenizer over the same vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, initializer_range=0.08)).float().eval()
    model.save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(SMOLLM2_135M["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="w2", pad_token="w2").save_pretrained(directory)
    return directory


def engine_for(model: str, device: str, dtype: str, **options):
    from batchserve.engine.llm_engine import LLMEngine

    return LLMEngine.from_options(model=model, device=device, dtype=dtype, **options)


def greedy(max_tokens: int):
    from batchserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompts(count: int, rng: random.Random, low: int, high: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(low, high + 1))] for _ in range(count)]


def check_parity(model: str, device: str, count: int, new_tokens: int, rng: random.Random) -> dict:
    """batchserve (one batch) vs transformers (one request at a time), float32, same device, prompts of 20-300."""
    from transformers import AutoModelForCausalLM

    engine = engine_for(model, device, "float32", max_batch_size=count)
    requests = prompts(count, rng, 20, 300, engine.model_config.vocab_size)
    for i, prompt in enumerate(requests):
        engine.add_request(str(i), prompt, greedy(new_tokens))
    ours: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ours[int(out.request_id)] = out.token_ids
    del engine
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    same, rows = 0, []
    for i, prompt in enumerate(requests):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
        theirs = out[0, len(prompt) :].tolist()
        agree = next((k for k, (a, b) in enumerate(zip(ours[i], theirs, strict=True)) if a != b), new_tokens)
        same += agree == new_tokens
        rows.append({"prompt_len": len(prompt), "tokens_in_agreement": agree})
    return {"requests": len(requests), "identical": same, "rows": rows}


def decode_rate(model, device, dtype, batch: int, prompt_len: int, steps: int, rng: random.Random) -> dict:
    engine = engine_for(model, device, dtype, max_batch_size=batch, max_num_tokens=max(2048, batch))
    vocab = engine.model_config.vocab_size
    for i, prompt in enumerate(prompts(batch, rng, prompt_len, prompt_len, vocab)):
        engine.add_request(str(i), prompt, greedy(steps + 8))
    while engine.scheduler.num_waiting or engine.last_stats is None or engine.last_stats.num_prefill_tokens:
        engine.step()
    engine.step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # returns after the sampled ids reach the host: the step is complete
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    return {"batch": batch, "step_ms": step * 1e3, "tok_per_s": batch / step}


def ttft(model, device, dtype, prompt_len: int, repeats: int, rng: random.Random) -> dict:
    engine = engine_for(model, device, dtype, max_num_tokens=max(2048, prompt_len))
    vocab = engine.model_config.vocab_size
    times = []
    for r in range(repeats + 1):  # the first is a warm-up
        engine.add_request(f"t{r}", prompts(1, rng, prompt_len, prompt_len, vocab)[0], greedy(1))
        start = time.perf_counter()
        while not any(out.token_ids for out in engine.step()):
            pass
        if r:
            times.append(time.perf_counter() - start)
    return {"prompt_len": prompt_len, "ttft_ms": statistics.median(times) * 1e3, "runs": len(times)}


def save(result: dict, out: Path, name: str) -> None:
    """One JSON result in `out`, named `name` and the time."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF directory or GGUF file (default: random weights of SmolLM2-135M's shapes)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the timings (parity is float32)")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt length of the decode runs")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--ttft-len", type=int, default=2048)
    ap.add_argument("--parity-requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per parity request")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    args = ap.parse_args()
    from batchserve.config import EngineConfig
    from batchserve.host.process import configure_torch

    configure_torch(None, EngineConfig().seed)  # once, for every engine of the process; torch's thread count
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(random_checkpoint(Path(tmp)))
        result = {"device": args.device, "dtype": args.dtype, "model": args.model or "random SmolLM2-135M shapes"}
        if args.device == "cuda":
            result["gpu"] = torch.cuda.get_device_name()
        result["parity"] = check_parity(model, args.device, args.parity_requests, args.new_tokens, rng)
        print(f"parity: {result['parity']['identical']}/{args.parity_requests} identical", flush=True)
        result["decode"] = []
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            row = decode_rate(model, args.device, args.dtype, batch, args.prompt_len, args.decode_steps, rng)
            result["decode"].append(row)
            print(f"decode B={batch}: {row['step_ms']:.2f} ms/step, {row['tok_per_s']:.0f} tok/s", flush=True)
        result["ttft"] = ttft(model, args.device, args.dtype, args.ttft_len, 3, rng)
        print(f"TTFT {args.ttft_len}-token prompt: {result['ttft']['ttft_ms']:.1f} ms", flush=True)
    save(result, args.out, f"gpu_check-{args.device}")


if __name__ == "__main__":
    main()
