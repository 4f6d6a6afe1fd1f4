"""Decode step of the native decoder loop (running the model's op plan) against the Python sequencing of the same
layers, on random-weight models of realistic widths, alternating the two in one process.

    .venv/bin/python benchmarks/op_plan_loop.py                                # qwen3, gemma2, qwen3_moe; B = 1, 32
    .venv/bin/python benchmarks/op_plan_loop.py --families llama --batch-sizes 64 --dtype float32

Each family is a SmolLM2-135M-like shape (hidden 576, 9 query / 3 KV heads of 64, MLP 1536; Qwen3-MoE: 8 experts of
384, top 2) with --layers layers and random weights, loaded through the engine's loader and laid out for the CPU.
A decode step is the model's forward over B sequences each with a --context-token context in the paged pool (the
logits are the same code either way and left out). The two sequencings share the model: the native loop, then the
Python layers (what BATCHSERVE_NATIVE_DECODER_LOOP=0 runs), taking turns step by step for --rounds rounds, so the host's
drift hits both alike. Prints the median step time of each and the ratio. `--clock cpu` (with --threads 1) times
each step by the calling thread's CPU clock, which the other load of a shared host does not inflate.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from batchserve.core.outputs import NewRequestData, SchedulerOutput
from batchserve.host.process import configure_torch
from batchserve.models.loader import load_model, load_model_config
from batchserve.sampling_params import SamplingParams
from batchserve.worker.input_batch import RequestTable

SMOL = dict(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
            head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)  # fmt: skip
FAMILIES = {
    "llama": lambda layers: transformers.LlamaConfig(**SMOL, num_hidden_layers=layers),
    "qwen3": lambda layers: transformers.Qwen3Config(**SMOL, num_hidden_layers=layers),
    "gemma2": lambda layers: transformers.Gemma2Config(
        **SMOL, num_hidden_layers=layers, sliding_window=4096, query_pre_attn_scalar=64,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
    ),
    "qwen3_moe": lambda layers: transformers.Qwen3MoeConfig(
        **SMOL, num_hidden_layers=layers, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384,
        norm_topk_prob=True,
    ),
}  # fmt: skip


def load(family: str, layers: int, dtype: torch.dtype, directory: Path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](layers))
    hf.save_pretrained(directory)
    config = load_model_config(directory)
    return config, load_model(directory, config, dtype, torch.device("cpu"))


def decode_batch(config, batch_size: int, context: int, block_size: int, dtype: torch.dtype):
    """A step of `batch_size` decodes over `context` tokens each, and a pool of random K/V holding them."""
    need = -(-(context + 1) // block_size)
    shape = (need * batch_size + 1, block_size, config.num_kv_heads, config.head_dim)
    kv = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(config.num_layers)]
    new = [
        NewRequestData(f"r{i}", [7] * (context + 1), context + 1, SamplingParams(temperature=0.0),
                       list(range(i * need, (i + 1) * need)), context)
        for i in range(batch_size)
    ]  # fmt: skip
    out = SchedulerOutput(new_requests=new, num_scheduled_tokens={r.req_id: 1 for r in new})
    table = RequestTable(block_size)
    table.apply(out)
    return table.build(out, torch.device("cpu")), kv


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def step_seconds(model, batch, kv, clock) -> float:
    start = clock()
    with torch.inference_mode():
        model(batch.input_ids, batch.positions, kv, batch.attn_metadata)
    return clock() - start


def measure(model, batch, kv, rounds: int, clock) -> tuple[float, float]:
    """Median step seconds of (native loop, Python sequencing), taking turns."""
    loop = model.decoder_loop
    assert loop is not None, "the native decoder loop does not run this model here"
    native, python = [], []
    for sequencing in [loop, None] * 2:  # warm-up
        model.decoder_loop = sequencing
        step_seconds(model, batch, kv, clock)
    for _ in range(rounds):
        model.decoder_loop = loop
        native.append(step_seconds(model, batch, kv, clock))
        model.decoder_loop = None
        python.append(step_seconds(model, batch, kv, clock))
    model.decoder_loop = loop
    return statistics.median(native), statistics.median(python)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="qwen3,gemma2,qwen3_moe")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="cpu: this thread's CPU time (--threads 1)")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu counts the calling thread only: use it with --threads 1")
    configure_torch(args.threads, 0)
    dtype = getattr(torch, args.dtype)
    print(
        f"{args.dtype}, {args.layers} layers, context {args.context}, {args.threads} threads, {args.clock} clock, "
        f"median of {args.rounds}"
    )
    print(f"{'family':>10} {'B':>4} {'native ms':>10} {'python ms':>10} {'speed-up':>9}")
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as directory:
            config, model = load(family, args.layers, dtype, Path(directory))
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            batch, kv = decode_batch(config, batch_size, args.context, 16, dtype)
            native, python = measure(model, batch, kv, args.rounds, CLOCKS[args.clock])
            print(f"{family:>10} {batch_size:>4} {native * 1e3:>10.2f} {python * 1e3:>10.2f} {python / native:>8.2f}x")


if __name__ == "__main__":
    main()
