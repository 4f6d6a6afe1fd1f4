"""KServe v2 tensors <-> Python values: inputs from `raw_input_contents` (Triton's binary layout, what tritonclient
sends) or typed `contents`, outputs as `raw_output_contents` (what Triton sends back). BYTES elements are 4-byte
little-endian lengths followed by the bytes."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchserve.entrypoints.grpc.status import invalid
from batchserve.entrypoints.kserve.pb import kserve_pb2 as pb

# KServe datatype -> (numpy little-endian dtype, the InferTensorContents field holding such values)
FIXED: dict[str, tuple[str, str]] = {
    "BOOL": ("?", "bool_contents"),
    "UINT8": ("<u1", "uint_contents"),
    "UINT16": ("<u2", "uint_contents"),
    "UINT32": ("<u4", "uint_contents"),
    "UINT64": ("<u8", "uint64_contents"),
    "INT8": ("<i1", "int_contents"),
    "INT16": ("<i2", "int_contents"),
    "INT32": ("<i4", "int_contents"),
    "INT64": ("<i8", "int64_contents"),
    "FP16": ("<f2", "fp32_contents"),
    "FP32": ("<f4", "fp32_contents"),
    "FP64": ("<f8", "fp64_contents"),
}
MAX_ELEMENTS = 1 << 20  # far above any TensorRT-LLM input; the message size limit binds first


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    values: list[Any]  # flattened: str for BYTES (UTF-8), bool, int or float otherwise


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, Tensor]:
    """Every input of the request by name; INVALID_ARGUMENT for unknown types, shapes that do not match the data,
    duplicates or text that is not UTF-8."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"raw_input_contents holds {len(raw)} entries for {len(request.inputs)} inputs", "inputs")
    tensors: dict[str, Tensor] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in tensors:
            raise invalid(f"input '{tensor.name}' is given twice", tensor.name)
        count = _element_count(tensor.name, tensor.shape)
        values = _raw_values(tensor, raw[i], count) if raw else _content_values(tensor, count)
        tensors[tensor.name] = Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), values)
    return tensors


def _element_count(name: str, shape: Sequence[int]) -> int:
    if any(d < 0 for d in shape):
        raise invalid(f"input '{name}' has a negative dimension in shape {list(shape)}", name)
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise invalid(f"input '{name}' has {count} elements, more than {MAX_ELEMENTS}", name)
    return count


def _raw_values(tensor: Any, data: bytes, count: int) -> list[Any]:
    if tensor.datatype == "BYTES":
        values = _split_bytes(tensor.name, data)
    elif tensor.datatype in FIXED:
        dtype = np.dtype(FIXED[tensor.datatype][0])
        if len(data) != count * dtype.itemsize:
            raise invalid(
                f"input '{tensor.name}': {len(data)} bytes of {tensor.datatype} data for shape {list(tensor.shape)}",
                tensor.name,
            )
        values = np.frombuffer(data, dtype).tolist()
    else:
        raise invalid(f"input '{tensor.name}' has an unsupported datatype '{tensor.datatype}'", tensor.name)
    return _checked(tensor, values, count)


def _content_values(tensor: Any, count: int) -> list[Any]:
    if tensor.datatype == "BYTES":
        values = [_text(tensor.name, b) for b in tensor.contents.bytes_contents]
    elif tensor.datatype in FIXED:
        values = list(getattr(tensor.contents, FIXED[tensor.datatype][1]))
    else:
        raise invalid(f"input '{tensor.name}' has an unsupported datatype '{tensor.datatype}'", tensor.name)
    return _checked(tensor, values, count)


def _checked(tensor: Any, values: list[Any], count: int) -> list[Any]:
    if len(values) != count:
        raise invalid(
            f"input '{tensor.name}' holds {len(values)} elements, its shape {list(tensor.shape)} says {count}",
            tensor.name,
        )
    return values


def _split_bytes(name: str, data: bytes) -> list[str]:
    values, offset = [], 0
    while offset < len(data):
        if offset + 4 > len(data):
            raise invalid(f"input '{name}': a BYTES element's 4-byte length is cut short", name)
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + length > len(data):
            raise invalid(f"input '{name}': a BYTES element runs past the end of its data", name)
        values.append(_text(name, data[offset : offset + length]))
        offset += length
    return values


def _text(name: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(f"input '{name}' is not valid UTF-8 text", name) from None


@dataclass(frozen=True)
class Output:
    name: str
    datatype: str  # BYTES, INT32 or FP32
    shape: tuple[int, ...]
    values: list[Any]  # flattened; str for BYTES

    def raw(self) -> bytes:
        if self.datatype == "BYTES":
            encoded = [v.encode("utf-8") for v in self.values]
            return b"".join(struct.pack("<I", len(e)) + e for e in encoded)
        return np.asarray(self.values, FIXED[self.datatype][0]).tobytes()


def add_outputs(response: pb.ModelInferResponse, outputs: Sequence[Output]) -> None:
    for output in outputs:
        response.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
        response.raw_output_contents.append(output.raw())
