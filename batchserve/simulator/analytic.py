"""An analytic profile for hardware we do not have: a roofline step-time ESTIMATE from a Llama-family model's shapes
and a device description (peak FLOP/s, memory bandwidth, memory size). The KV pool is what the engine would give
itself: the memory left after the weights times the default fraction (worker/kv_cache.py: 0.9 on a GPU; 0.25,
at most 4 GiB, on a CPU)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from batchserve.config import ModelConfig
from batchserve.simulator.profile_file import Profile
from batchserve.simulator.step_model import RooflineStepModel

GiB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CPU_DEFAULT_MAX_BYTES = 4 * GiB  # worker/kv_cache.py's cap on the CPU default pool


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16/fp16 FLOP/s from the datasheet
    bandwidth: float  # memory bytes/s from the datasheet
    memory_bytes: float
    kind: str = "gpu"
    compute_efficiency: float = 0.6  # share of peak a well-shaped GEMM reaches
    bandwidth_efficiency: float = 0.8  # share of bandwidth a weight or K/V stream reaches
    overhead_s: float = 3e-3  # per step: our Python scheduler, batch building and kernel launches
    overhead_per_seq_s: float = 2e-5


def this_cpu() -> Device:
    """A crude preset for this host: 2.5 GHz x FMA width per core (x2 with bf16 units), 10 GB/s per core up to 100;
    `batchserve profile` measures instead of guessing and should be preferred here."""
    from batchserve.bench.machine import machine_info

    info = machine_info()
    cores = info["cpu_count"] or 1
    per_cycle = 64 if "avx512f" in info["cpu_flags"] else 32
    per_cycle *= 2 if info["bf16_units"] else 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device(f"this CPU ({info['cpu']}, {cores} CPUs)", 2.5e9 * per_cycle * cores, min(100e9, 10e9 * cores),
                  mem, "cpu", 0.5, 0.6, 2e-3, 5e-5)  # fmt: skip


DEVICES: dict[str, Device | None] = {
    "h100-sxm": Device("NVIDIA H100 SXM 80GB", 989e12, 3.35e12, 80 * GiB),
    "h200": Device("NVIDIA H200 141GB", 989e12, 4.8e12, 141e9),
    "a100-80gb": Device("NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80 * GiB),
    "a100-40gb": Device("NVIDIA A100 40GB", 312e12, 1.555e12, 40 * GiB),
    "l4": Device("NVIDIA L4 24GB", 121e12, 300e9, 24 * GiB),
    "this-cpu": None,  # built when asked for (reads this host)
}


@dataclass(kw_only=True)
class Shapes(ModelConfig):
    """What the cost depends on: the engine's ModelConfig, named. Read from a Llama-family model by the models loader
    (a config.json file, a Hugging Face directory or a .gguf file), or one of MODEL_SHAPES."""

    name: str

    @classmethod
    def from_model_config(cls, config: ModelConfig, name: str) -> Shapes:
        return cls(name=name, **{f.name: getattr(config, f.name) for f in fields(ModelConfig)})

    @classmethod
    def from_config_json(cls, path: str | Path) -> Shapes:
        """From a config.json file, a Hugging Face model directory or a .gguf file, as the engine reads them."""
        from batchserve.models.loader import ModelLoadError, load_model_config, resolve_model_path  # imports torch

        given = path = Path(path).expanduser()
        if path.is_file() and path.name == "config.json":
            path = path.parent  # the loader reads a model directory's config.json
        try:
            if path.is_file() and path.suffix == ".json":  # a config.json saved under another name
                with tempfile.TemporaryDirectory() as tmp:
                    shutil.copyfile(path, Path(tmp) / "config.json")
                    return cls.from_model_config(load_model_config(Path(tmp)), path.stem)
            path = resolve_model_path(path)
            return cls.from_model_config(load_model_config(path), path.stem if path.is_file() else path.resolve().name)
        except (ModelLoadError, KeyError) as exc:  # the CLI reports a ValueError as a usage error
            detail = f"no {exc} in its config" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"cannot read model shapes from {given}: {detail}") from exc

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return self.num_layers * self.layer_params + self.head_params * (1 if self.tie_word_embeddings else 2)


MODEL_SHAPES = {
    "smollm2-135m": Shapes(name="SmolLM2-135M", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                           tie_word_embeddings=True),
    "llama-3-8b": Shapes(name="Llama-3-8B", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192),
    "llama-2-7b": Shapes(name="Llama-2-7B", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096),
    "qwen2-7b": Shapes(name="Qwen2-7B", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=32768,
                       attention_bias=True, architecture="qwen2"),
}  # fmt: skip


def resolve_device(name: str) -> Device:
    if name not in DEVICES:
        raise ValueError(f"unknown device preset {name!r}; choose from {', '.join(sorted(DEVICES))}")
    return DEVICES[name] or this_cpu()


def resolve_shapes(name: str) -> Shapes:
    return MODEL_SHAPES[name] if name in MODEL_SHAPES else Shapes.from_config_json(name)


def roofline_model(shapes: Shapes, device: Device, dtype: str) -> RooflineStepModel:
    elem = DTYPE_BYTES[dtype]
    return RooflineStepModel(
        flops_per_token=2.0 * shapes.num_layers * shapes.layer_params,
        flops_per_sample=2.0 * shapes.head_params,
        flops_per_pair=4.0 * shapes.num_layers * shapes.num_heads * shapes.head_dim,
        weight_bytes=float((shapes.num_layers * shapes.layer_params + shapes.head_params) * elem),
        kv_bytes_per_token=float(kv_bytes_per_token(shapes, dtype)),
        peak_flops=device.peak_flops * device.compute_efficiency,
        bandwidth=device.bandwidth * device.bandwidth_efficiency,
        overhead_s=device.overhead_s, overhead_per_seq_s=device.overhead_per_seq_s,
        notes={"device": device.name, "model": shapes.name, "estimate": True},
    )  # fmt: skip


def kv_bytes_per_token(shapes: Shapes, dtype: str) -> int:
    """host/memory.block_bytes for a block of one token: K and V, every layer."""
    return 2 * shapes.num_layers * shapes.num_kv_heads * shapes.head_dim * DTYPE_BYTES[dtype]


def kv_pool_bytes(shapes: Shapes, device: Device, dtype: str) -> tuple[int, int]:
    """(memory free after the weights, the default pool) as the engine computes them."""
    free = int(device.memory_bytes - shapes.total_params * DTYPE_BYTES[dtype])
    if free <= 0:
        raise ValueError(f"{shapes.name} in {dtype} does not fit in {device.name}'s memory")
    pool = int(free * 0.9) if device.kind == "gpu" else min(int(free * 0.25), CPU_DEFAULT_MAX_BYTES)
    return free, pool


def analytic_profile(model: str, device_name: str, dtype: str = "bfloat16") -> Profile:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}")
    shapes, device = resolve_shapes(model), resolve_device(device_name)
    free, pool = kv_pool_bytes(shapes, device, dtype)
    return Profile(
        source="analytic", step_model=roofline_model(shapes, device, dtype), model=shapes.name, dtype=dtype,
        kv_bytes_per_token=kv_bytes_per_token(shapes, dtype), kv_cache_bytes=pool,
        max_model_len=shapes.max_position_embeddings, memory_free_bytes=free,
        machine={"name": device.name, **asdict(device)}, notes={"estimate": "roofline; no step was measured"},
    )  # fmt: skip
