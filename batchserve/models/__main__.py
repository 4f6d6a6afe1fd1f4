"""`python -m batchserve.models`: convert the default model's GGUF file into the conversion cache now. Set-up does,
beside the kernel build, so that neither a test nor a first request pays for it (~15 CPU-s on a 2-core host; the
suite's first start of the default model took that long on a fresh clone). Prints the folder, or why there is none;
exits 0 either way, as a model that is not converted now is converted at its first start."""

from __future__ import annotations

import sys

from batchserve.models.loader import ModelLoadError, ensure_gguf_cache, resolve_model_path


def main() -> int:
    try:
        folder = ensure_gguf_cache(resolve_model_path(None))
    except (ModelLoadError, OSError) as exc:
        print(f"default model: not converted ({exc}); its first start converts it")
        return 0
    print(f"default model: converted ({folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
