"""The native prefill kernel on the default model's own queries and keys: a long prompt's last chunk, every layer.

Random queries and keys (prefill_amx.py) spread their scores evenly; a model's attention is peaked where it is, flat
elsewhere, and that decides how many key tiles the avx512_bf16 kernel multiplies at one rounding. So this captures,
once, each layer's last prefill chunk of a random-token prompt (its queries and the pool's keys and values up to it)
and then times the kernel on them, layer after layer, by the CPU clock of one thread.

    PYTHONPATH=<checkout> .venv/bin/python benchmarks/prefill_model_chunk.py capture --context 8192 --to DIR
    PYTHONPATH=<checkout> .venv/bin/python benchmarks/prefill_model_chunk.py time DIR --rounds 3

`capture` runs the whole prefill (chunks of 2,048, the Python layers so that each layer's attention call can be read;
minutes at 32k) and saves one file per layer. `time` prints the CPU seconds of all layers' calls per round: run it
from two checkouts in turns to compare kernels on the same inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def capture(context: int, folder: Path, threads: int) -> None:
    os.environ["BATCHSERVE_NATIVE_DECODER_LOOP"] = "0"  # the Python layers: each attention call passes through here
    import limits

    from batchserve.layers import attention
    from batchserve.models import llama

    folder.mkdir(parents=True, exist_ok=True)
    attend, layer = attention.paged_attention, [0]

    def saving(query, key, value, kv_cache, metadata, scale=None, window=None, softcap=None):
        out = attend(query, key, value, kv_cache, metadata, scale, window, softcap)
        chunk = metadata.prefill
        if chunk is not None and int(chunk.seq_lens.max()) == context:
            blocks = chunk.block_tables[0, : -(-context // kv_cache[0].shape[1])]
            torch.save({"query": query.clone(), "key": kv_cache[0][blocks].clone(), "value": kv_cache[1][blocks].clone(),
                        "rows": query.shape[0], "context": context,
                        "scale": scale if scale is not None else query.shape[-1] ** -0.5},
                       folder / f"layer{layer[0]:03d}.pt")  # fmt: skip
            layer[0] += 1
        return out

    attention.paged_attention = llama.paged_attention = saving
    args = limits.parse_args(["--sections", "prefill", "--threads", str(threads)])
    torch.set_num_threads(threads)
    model = str(limits.default_model_with_positions(context + 2048, Path(tempfile.mkdtemp()) / "model"))
    engine = limits.new_engine(args, model, num_kv_blocks=context // 16 + 4, max_num_tokens=2048,
                               max_model_len=context + 16)  # fmt: skip
    vocab = engine.model_config.vocab_size
    start = time.perf_counter()
    limits.run_prefill(engine, limits.prompt(vocab, context, 1), time.perf_counter)
    engine.close()
    print(f"captured {layer[0]} layers' last chunk in {time.perf_counter() - start:.0f} s into {folder}")


def time_layers(folder: Path, rounds: int) -> None:
    from batchserve.bench.machine import describe, machine_info
    from batchserve.layers import kernels

    torch.set_num_threads(1)
    native, isa = kernels.load(), kernels.prefill_kernel_isa()
    layers = [torch.load(f) for f in sorted(folder.glob("layer*.pt"))]
    print(describe(machine_info(threads=1)))
    print(f"{len(layers)} layers, {layers[0]['rows']} rows after {layers[0]['context'] - layers[0]['rows']} keys, "
          f"prefill kernel path {isa.name}; load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for r in range(rounds):
        seconds = 0.0
        for c in layers:
            n = c["context"]
            tables = torch.arange(c["key"].shape[0]).view(1, -1)
            lens, starts = torch.tensor([n]), torch.tensor([0, c["rows"]])
            args = (c["key"], c["value"], tables, lens, starts, c["scale"], kernels.attention_path(), isa)
            begin = time.thread_time()
            native.paged_prefill_attention(c["query"], *args)
            seconds += time.thread_time() - begin
        print(f"round {r}: {seconds:.2f} CPU s (load average {os.getloadavg()[0]:.2f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture", help="run the prefill and save each layer's last chunk")
    cap.add_argument("--context", type=int, default=8192)
    cap.add_argument("--to", type=Path, required=True)
    cap.add_argument("--threads", type=int, default=2)
    tim = sub.add_parser("time", help="time the prefill kernel on the saved chunks, 1 thread, CPU clock")
    tim.add_argument("folder", type=Path)
    tim.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.command == "capture":
        capture(args.context, args.to, args.threads)
    else:
        time_layers(args.folder, args.rounds)


if __name__ == "__main__":
    main()
