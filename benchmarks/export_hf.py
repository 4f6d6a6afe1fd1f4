"""Export the default GGUF model (SmolLM2-135M-Instruct Q4_1) as a dequantized Hugging Face directory.

vLLM's CPU build does not run Q4_1 GGUF llama models, so the peer comparison points vLLM (and the transformers
baselines, for consistency) at this directory: the same weights, dequantized once by transformers' GGUF loader.

    .venv/bin/python benchmarks/export_hf.py              # into $BATCHSERVE_HF_EXPORT, else bench_results/smollm2-hf
    .venv/bin/python benchmarks/export_hf.py --out DIR    # anywhere else
"""

from __future__ import annotations

import argparse
from pathlib import Path

from make_workload import MODEL_FILE, model_dir

from batchserve import env


def export(out: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = model_dir()
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=MODEL_FILE, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model loaded through the GGUF "quantizer", though its weights are already plain
    # float tensors: write the config (without the GGUF marker) and the weights ourselves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    # Tied embeddings: keep embed_tokens (what loaders expect), drop the lm_head alias of it.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", type=Path, default=None, help="default: $BATCHSERVE_HF_EXPORT, else bench_results/smollm2-hf"
    )
    args = ap.parse_args()
    out = export(args.out or env.hf_export_dir())
    print(f"exported to {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
