"""quantization auto, the default: a GGUF file runs its codes as stored (as quantization gguf) where the kernel
table's rule finds that faster on this CPU (layers/kernels/paths.py gguf_as_stored_rule), else it loads dequantized
(as quantization none). Decided once at start-up, before the mode table, and said in one log line
(docs/quantization.md#quantization-auto)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from batchserve.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)

AUTO = "auto"
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class AutoChoice:
    """What quantization auto runs ("gguf" or "none"), why, and on which quantized GEMM path (gguf: weight-only)."""

    quantization: str
    reason: str
    quant_gemm_path: str | None = None

    def line(self, dtype: str) -> str:
        what = "gguf as stored" if self.quantization == "gguf" else f"dequantized to {_SHORT_DTYPE.get(dtype, dtype)}"
        return f"quantization auto: {what} ({self.reason}; docs/quantization.md#quantization-auto)"


def host() -> tuple[str, frozenset[tuple[str, str]] | None]:
    """This CPU's flags and this build's kernel table, as the rule reads them (a test forces another host class's
    here: tests/forcing.py)."""
    from batchserve.layers import kernels

    return kernels.cpu_flags(), kernels.built_here()


def choose(config: EngineConfig, path: Path, model_config: ModelConfig, device: str, dtype: str) -> AutoChoice:
    """quantization auto's answer for this model file, device and resolved dtype ("bfloat16", "float32", ...)."""
    from batchserve.layers.kernels.paths import gguf_as_stored_rule
    from batchserve.models.gguf_quantized import first_matrix_not_as_stored
    from batchserve.models.loader import gguf_tensor_types, is_gguf

    if not is_gguf(path):
        return AutoChoice("none", "not a GGUF file: no stored codes")
    if device != "cpu":
        return AutoChoice("none", f"device {device}: the quantized kernels run on the CPU only")
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        return AutoChoice("none", "the model is split over ranks, which hold float shards")
    if config.enable_lora:  # adapters over the file's codes are not tested or measured: the tested float layers
        return AutoChoice("none", "enable_lora: adapters run over the dequantized projections")
    if model_config.num_experts > 0:
        return AutoChoice("none", "a mixture-of-experts model: its experts do not run as stored")
    unstored = first_matrix_not_as_stored(gguf_tensor_types(path))
    if unstored is not None:
        return AutoChoice("none", f"tensor {unstored}: a type the as-stored kernels do not take")
    flags, built = host()
    rule = gguf_as_stored_rule(dtype, flags, os.environ, built)
    return AutoChoice("gguf" if rule.as_stored else "none", rule.reason, rule.quant_gemm_path)


def resolve_quantization(
    config: EngineConfig, path: Path, model_config: ModelConfig, device: str, dtype: str
) -> AutoChoice | None:
    """config.quantization auto -> its effective value, set in `config` (as logs and /v1/models report it) and said
    in one line; another value is left as asked (None)."""
    if config.quantization != AUTO:
        return None
    choice = choose(config, path, model_config, device, dtype)
    config.quantization = choice.quantization
    logger.info(choice.line(dtype))
    return choice
