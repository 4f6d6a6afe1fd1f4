"""GGUF weights, one tensor at a time: each tensor is read from the memory-mapped file, dequantized alone, converted
and handed on before the next is touched, so converting a file takes the final weights plus one tensor of memory
(never the whole model in float32). Also: the checkpoint's weight bytes at a load dtype, read from headers only, for
the memory check before loading."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from batchserve.config import ConfigError

# The types llama.cpp users ship; gguf.quants.dequantize handles each (tests/models/test_gguf_weights.py checks them).
SUPPORTED_TYPE_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


# in an HF name a name map gives a stacked expert tensor (ffn_*_exps): split into one tensor per expert there
EXPERT = "{expert}"


class UnsupportedGGUFTensor(ConfigError, ValueError):
    """A tensor of a quantization type this loader does not convert."""


def supported_types() -> frozenset:
    import gguf

    return frozenset(gguf.GGMLQuantizationType[name] for name in SUPPORTED_TYPE_NAMES)


def check_tensor_type(tensor) -> None:
    if tensor.tensor_type not in supported_types():
        raise UnsupportedGGUFTensor(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPE_NAMES)})"
        )


def torch_shape(tensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; torch's [out, in] is the reverse."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


DEQUANTIZE_CHUNK_BYTES = 1 << 26  # a quantized tensor is widened this many of its bytes at a time


def dequantize(tensor) -> np.ndarray:
    """One tensor as float32 in torch's layout (dequantize returns [rows, cols] row-major: already [out, in]). A
    quantized tensor is widened in chunks of rows into its output, so gguf's float temporaries stay small (an 8B
    model's embedding table is 2 GB in float32)."""
    return dequantize_as(tensor, torch.float32).numpy()


def dequantize_as(tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize(tensor) converted to `dtype`; a chunked one chunk by chunk into the result, so that no float32 copy
    of the whole tensor is ever held (loading an 8B embedding table in bf16: 1 GB of result, not 2 more of float32)."""
    import gguf

    chunks = _float32_chunks(tensor)
    if chunks is None:  # an F32 tensor is a view of the mmap'd file: own a copy
        whole = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        return torch.from_numpy(whole if whole.flags.writeable else whole.copy()).to(dtype).reshape(torch_shape(tensor))
    out = torch.empty(tensor.data.shape[0], int(np.prod(torch_shape(tensor))) // tensor.data.shape[0], dtype=dtype)
    for rows, chunk in chunks:
        out[rows] = torch.from_numpy(chunk)
    return out.reshape(torch_shape(tensor))


def _float32_chunks(tensor) -> Iterator[tuple[slice, np.ndarray]] | None:
    """(rows of the file's data, those rows dequantized to float32 [rows, -1]) for a quantized tensor over
    DEQUANTIZE_CHUNK_BYTES, else None (taken whole: float types, small tensors)."""
    import gguf

    check_tensor_type(tensor)
    data = tensor.data
    if (
        _storage_dtype(tensor) != torch.float32
        or tensor.tensor_type.name == "F32"
        or data.nbytes <= DEQUANTIZE_CHUNK_BYTES
    ):
        return None
    step = max(1, DEQUANTIZE_CHUNK_BYTES // (data.nbytes // data.shape[0]))

    def chunks():
        for start in range(0, data.shape[0], step):
            chunk = gguf.quants.dequantize(data[start : start + step], tensor.tensor_type)
            yield slice(start, start + len(chunk)), chunk.reshape(len(chunk), -1)

    return chunks()


def unpermute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of q/k rows (its RoPE pairs adjacent dims; HF pairs halves)."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _storage_dtype(tensor) -> torch.dtype:
    """F16/BF16 tensors keep their type (exact); every other type dequantizes to float32."""
    name = tensor.tensor_type.name
    return {"F16": torch.float16, "BF16": torch.bfloat16}.get(name, torch.float32)


def iter_gguf_tensors(
    reader,
    to_hf_name: Callable[[str], str | None],
    qk_heads: tuple[int, int] | None,
    dtype: torch.dtype | None = None,
    norm_shift: float = 0.0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for each mapped tensor, one at a time. `qk_heads`: (num_heads, num_kv_heads) when q/k rows
    were permuted by llama.cpp's converter (llama), else None. `dtype`: the output type (None: F16/BF16 tensors
    keep theirs, others float32). `norm_shift`: what the converter added to every norm weight (Gemma: 1), taken
    off again. Every tensor's type is checked before the first is converted."""
    mapped = [(name, t) for t in reader.tensors if (name := to_hf_name(t.name)) is not None]
    for _, tensor in mapped:
        check_tensor_type(tensor)
    for name, tensor in mapped:
        out = _converted(tensor, name, qk_heads, dtype or _storage_dtype(tensor), norm_shift)
        if EXPERT in name:  # llama.cpp stacks a layer's experts in one tensor; HF checkpoints hold one per expert
            for expert in range(out.shape[0]):
                yield name.replace(EXPERT, str(expert)), out[expert].clone()
        else:
            yield name, out


def _converted(tensor, name: str, qk_heads, dtype: torch.dtype, norm_shift: float) -> torch.Tensor:
    """One mapped tensor in `dtype`: q/k rows in HF's order, a norm's shift taken off (in float32: exact)."""
    if norm_shift and name.endswith("norm.weight"):  # exact: 1 + w then - 1 gives back what 1 + w rounded to
        return torch.from_numpy(dequantize(tensor) - np.float32(norm_shift)).to(dtype)
    out = dequantize_as(tensor, dtype)
    if qk_heads is not None and name.endswith("q_proj.weight"):
        out = unpermute_qk(out, qk_heads[0]).contiguous()
    elif qk_heads is not None and name.endswith("k_proj.weight"):
        out = unpermute_qk(out, qk_heads[1]).contiguous()
    return out


# --- a safetensors file written tensor by tensor -----------------------------------------------------------------

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_safetensors_streaming(
    path: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]], tensors: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """A safetensors file whose header comes from `plan` (name, shape, dtype, in order), then each tensor's bytes as
    it arrives: safetensors.save_file would need every tensor in memory at once."""
    header, offset = {}, 0
    for name, shape, dtype in plan:
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, shape, dtype), (got_name, tensor) in zip(plan, tensors, strict=True):
            if (got_name, tuple(tensor.shape), tensor.dtype) != (name, tuple(shape), dtype):
                raise ValueError(f"{got_name} {tuple(tensor.shape)} {tensor.dtype}: expected {name} {shape} {dtype}")
            f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def gguf_cache_plan(reader, to_hf_name: Callable[[str], str | None]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What iter_gguf_tensors(dtype=None) yields, from the header alone."""
    plan = []
    for tensor in reader.tensors:
        name, shape, dtype = to_hf_name(tensor.name), torch_shape(tensor), _storage_dtype(tensor)
        if name is not None and EXPERT in name:
            plan += [(name.replace(EXPERT, str(expert)), shape[1:], dtype) for expert in range(shape[0])]
        elif name is not None:
            plan.append((name, shape, dtype))
    return plan


def write_gguf_as_safetensors(
    reader,
    path: Path,
    to_hf_name: Callable[[str], str | None],
    qk_heads: tuple[int, int] | None,
    norm_shift: float = 0.0,
) -> None:
    tensors = iter_gguf_tensors(reader, to_hf_name, qk_heads, norm_shift=norm_shift)
    write_safetensors_streaming(path, gguf_cache_plan(reader, to_hf_name), tensors)


# --- weight bytes from headers ------------------------------------------------------------------------------------


def gguf_num_elements(reader, to_hf_name: Callable[[str], str | None]) -> int:
    return sum(int(t.n_elements) for t in reader.tensors if to_hf_name(t.name) is not None)


def safetensors_num_elements(folder: Path) -> int:
    """Elements of every tensor in the folder's *.safetensors files, from their headers (nothing loaded)."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(int(np.prod(v["shape"], dtype=np.int64)) for k, v in header.items() if k != "__metadata__")
    return total


def checkpoint_weight_bytes(
    path: Path, to_hf_name: Callable[[str], str | None], dtype: torch.dtype, reader=None
) -> int:
    """Bytes the loaded weights take at `dtype`, from the checkpoint's headers (a GGUF file via `reader`, or an HF
    folder's *.safetensors); 0 when the folder has none (pytorch_model*.bin: not counted)."""
    elements = gguf_num_elements(reader, to_hf_name) if reader is not None else safetensors_num_elements(path)
    return elements * torch.empty((), dtype=dtype).element_size()
