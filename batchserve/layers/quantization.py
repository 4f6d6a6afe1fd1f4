"""Weights kept quantized (the `quantization` option, vLLM's name): int8 per output channel or int4 in groups of 32, 64
or 128 k, both symmetric, quantized once at load and run as stored by the native quantized GEMM
(kernels/quant_gemm.cpp), whose Projection the native decoder loop calls like any other (docs/quantization.md).

Codes are laid out in 32-k subblocks: int8 [N, K]; int4 packed [N, K / 2], per subblock 16 bytes whose low nibble is
k = j and high nibble k = j + 16 (GGUF Q4_0's order, so its blocks repack without re-quantizing), stored + 8.
Scales float32 [N, K / group]. A weight value is code * scale, the product the kernels form in float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from batchserve import env
from batchserve.config import QUANTIZATIONS, ConfigError
from batchserve.layers import kernels
from batchserve.layers.linear import ALL_ROWS, DEFAULT_POLICY, CpuLinear, LinearPolicy, layout_policy, loading_policy

logger = logging.getLogger(__name__)

SUBBLOCK = 32  # k per subblock of the kernels' code layout
INT4_GROUPS = (32, 64, 128)
# The quantized GEMM's instruction-set paths, best first (quant_gemm.h QuantPath). avx512_vnni is W8A8 at every M
# (activations quantized per row to int8, quant_w8a8.cpp) where the weight's groups allow it, else avx512's kernel.
W8A8_PATH = "avx512_vnni"


@dataclass(frozen=True)
class QuantScheme:
    """bits 8 or 4; group: k per scale (None: one scale per output channel, the whole row)."""

    bits: int
    group: int | None

    @property
    def name(self) -> str:
        return "int8" if self.bits == 8 else f"int4_g{self.group}"

    def group_for(self, in_features: int) -> int:
        return in_features if self.group is None else self.group


def parse_quantization(name: str) -> QuantScheme | None:
    """An option value -> the scheme projections are quantized in at load (None for "none", and for "gguf": a GGUF
    file's own codes, models/gguf_quantized.py). "int4" is int4 in groups of 32 (GGUF Q4_0's group)."""
    if name not in QUANTIZATIONS:
        raise ConfigError(f"quantization {name!r}: not one of {', '.join(QUANTIZATIONS)}")
    if name == "auto":  # an engine resolves it before loading (engine/auto_quantization.py); a caller here must too
        raise ConfigError("quantization auto: resolve it to none or gguf before loading (resolve_quantization)")
    if name in ("none", GGUF_AS_STORED):
        return None
    if name == "int8":
        return QuantScheme(8, None)
    return QuantScheme(4, int(name.removeprefix("int4").removeprefix("_g") or 32))


GGUF_AS_STORED = "gguf"  # a GGUF file's quantized tensors run as stored (layers/gguf_codes.py)


# ---- quantize / dequantize (torch; the layout of quant_gemm.h) -------------------------------------------------------


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes, scales float32 [N, K / group]); round to nearest, so |w - dequantized| <= |scale| / 2
    but where int4 clamps a value to code -8 or 7 (with a scale finer than the extreme needs): there within two
    |scale|."""
    n, k = weight.shape
    group = scheme.group_for(k)
    check_shape(scheme, k)
    w = weight.detach().float().reshape(n, k // group, group)
    low, high = (-127.0, 127.0) if scheme.bits == 8 else (-8.0, 7.0)
    if scheme.bits == 8:
        scales = _nonzero(w.abs().amax(dim=-1) / 127.0)
    else:
        scales = _as_float16_where_normal(_int4_scales(w))
    codes = torch.round(w / scales.unsqueeze(-1)).clamp(low, high).reshape(n, k)
    if scheme.bits == 8:
        return codes.to(torch.int8).contiguous(), scales.contiguous()
    return pack_int4(codes.to(torch.int16) + 8), scales.contiguous()


# int4 scales tried per group, as fractions of GGUF Q4_0's (the largest-magnitude value at code -8), the one with the
# least squared error kept. Q4_0's alone: a search over 0.8-1.0 lowered the squared error but raised the KL from
# float32 on the default model (clamped outliers cost more than finer steps gain; docs/quantization.md)
INT4_SCALE_FRACTIONS = (1.0,)


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    return torch.where(scales != 0, scales, torch.ones_like(scales))  # an all-zero group: codes 0 whatever the scale


def _as_float16_where_normal(scales: torch.Tensor) -> torch.Tensor:
    """int4 scales rounded to float16 values (as GGUF stores its scales) where float16 holds them as normal numbers:
    the W8A8 kernel then packs them in 2 bytes, not 4 (0.5625 byte a weight at group 32, not 0.625)."""
    rounded = scales.half().float()
    normal = torch.isfinite(rounded) & (rounded.abs() >= torch.finfo(torch.float16).tiny)
    return torch.where(normal, rounded, scales)


def _int4_scales(w: torch.Tensor) -> torch.Tensor:
    """Per group [N, G] of w [N, G, group]: a signed scale (so all 16 levels are used), the best of the fractions."""
    extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    best, best_error = None, None
    for fraction in INT4_SCALE_FRACTIONS:
        scales = _nonzero(extreme / -8.0 * fraction)
        codes = torch.round(w / scales.unsqueeze(-1)).clamp(-8.0, 7.0)
        error = (codes * scales.unsqueeze(-1) - w).square().sum(-1)
        if best is None:
            best, best_error = scales, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, scales, best), torch.where(better, error, best_error)
    return best


def pack_int4(unsigned: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K / 2] uint8 in the subblock order (module docstring)."""
    n, k = unsigned.shape
    halves = unsigned.to(torch.uint8).reshape(n, k // SUBBLOCK, 2, SUBBLOCK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [N, K / 2] uint8 -> [N, K] values 0..15 (int16)."""
    n, half = packed.shape
    sub = packed.reshape(n, half * 2 // SUBBLOCK, SUBBLOCK // 2).to(torch.int16)
    return torch.stack((sub & 15, sub >> 4), dim=2).reshape(n, half * 2)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """(codes, scales) -> float32 [N, K], each value code * scale in float32 (what the kernels multiply by)."""
    values = codes.to(torch.int16) if bits == 8 else unpack_int4(codes) - 8
    group = values.shape[1] // scales.shape[1]
    return values.float() * scales.repeat_interleave(group, dim=1)


def check_shape(scheme: QuantScheme, in_features: int) -> None:
    """ConfigError naming what would work where a weight's K does not fit the scheme's groups."""
    group = scheme.group_for(in_features)
    if in_features % SUBBLOCK or in_features % group:
        fits = [f"int4_g{g}" for g in INT4_GROUPS if in_features % g == 0]
        raise ConfigError(
            f"quantization {scheme.name}: a projection's input size {in_features} is not a multiple of "
            f"{group if in_features % SUBBLOCK == 0 else SUBBLOCK}; "
            + (f"{', '.join(fits)} would work" if fits else "use quantization none for this model")
        )


# ---- the kernel path -------------------------------------------------------------------------------------------------


QUANT_GEMM_PATHS = kernels.OPERATIONS["quant_gemm"].names


def quant_gemm_path_runs(path: str) -> bool:
    return kernels.load() is not None and kernels.path_runs("quant_gemm", path)


@functools.cache
def quant_gemm_path() -> str:
    """The quantized GEMM's path, chosen once from the kernel table (kernels/paths.py): BATCHSERVE_QUANT_GEMM_PATH when
    set (ValueError naming the paths that run here when it names one that does not), else the best this build and
    CPU run."""
    return kernels.chosen_path("quant_gemm")


def policy_gemm_path(policy: LinearPolicy) -> str:
    """The path a projection laid out under `policy` takes: a forced BATCHSERVE_QUANT_GEMM_PATH (checked as
    quant_gemm_path does), else the policy's (quantization auto's weight-only path), else the kernel table's."""
    if env.quant_gemm_path() is None and policy.quant_gemm_path is not None:
        if not quant_gemm_path_runs(policy.quant_gemm_path):
            raise ValueError(f"quantized GEMM path {policy.quant_gemm_path!r}: not built here or not runnable here")
        return policy.quant_gemm_path
    return quant_gemm_path()


# ---- the layer -------------------------------------------------------------------------------------------------------


def active_scheme() -> QuantScheme | None:
    """The scheme of the model being loaded (the loading policy's: quantized_linears), else None."""
    return loading_policy().scheme


def gguf_as_stored() -> bool:
    """Whether the model loading now runs a GGUF file's quantized tensors as stored (quantization gguf)."""
    return loading_policy().gguf_as_stored


def linear_policy(
    name: str, dtype: torch.dtype | None = None, base: LinearPolicy = DEFAULT_POLICY, gemm_path: str | None = None
) -> LinearPolicy:
    """`base` with quantization `name`: decoder layers' projections (not the output projection, whose float32 logits
    stay unquantized) kept quantized in its scheme (on the CPU: the mode table, batchserve/modes.py, refuses another
    device before loading). `dtype` bfloat16 on a CPU with bf16 units: many rows multiply dequantized tiles in bf16,
    as the bf16 model's own GEMMs would. `gemm_path`: the quantized GEMM's path (None: the kernel table's;
    LinearPolicy.quant_gemm_path)."""
    scheme = parse_quantization(name)
    if name != "none" and kernels.load() is not None:
        quant_gemm_path()  # a forced path this CPU cannot run is refused here, at load
    return dataclasses.replace(
        base,
        scheme=scheme,
        gguf_as_stored=name == GGUF_AS_STORED,
        bf16_tiles=dtype == torch.bfloat16 and kernels.has_matmul_units(torch.bfloat16),
        quant_gemm_path=gemm_path,
    )


@contextlib.contextmanager
def quantized_linears(name: str, dtype: torch.dtype | None = None, gemm_path: str | None = None):
    """The loading policy with quantization `name` (linear_policy) inside: the model's layout code hands it to the
    projections it builds."""
    with layout_policy(linear_policy(name, dtype, loading_policy(), gemm_path)) as policy:
        yield policy


class QuantizedLinear(CpuLinear):
    """A projection whose weight is kept quantized: the native quantized GEMM at every M (path avx512_vnni: W8A8,
    the codes repacked at load and the activations rounded to int8 per ACT_BLOCK k; other paths: registers below
    SMALL_MAX_M rows, dequantized tiles and a library GEMM above; one order per row at every M in deterministic
    mode), through a native Projection as CpuLinear's; without the native kernels the torch code on the weight
    dequantized per call."""

    SMALL_MAX_M = 64  # measured against the dequantized float32 tiles on SmolLM2 shapes (docs/quantization.md)
    SMALL_MAX_M_BF16_TILES = 16  # against bf16 tiles: they win from about 16-24 rows on the same shapes
    # path avx512_vnni: W8A8 at every M (faster than the register path from one row, and one order per row, so
    # deterministic mode keeps it), the activations quantized per row and block of ACT_BLOCK k (0: the whole row;
    # never across a weight group): 16 is the largest block whose KL from float32 stays within llama.cpp's on the
    # default model (docs/quantization.md)
    ACT_BLOCK = 16
    ACT_BLOCK_LOGITS = 32  # the output projection (GGUF's): 32 keeps gguf's KL within llama.cpp's too
    # a bf16 model on AMX (the bf16 GEMM path amx or amx_emulated): from AMX_MIN_M rows the weight is dequantized
    # into bf16 tiles per 32 columns once a call and multiplied on AMX (quant_amx.cpp); fewer rows stay on W8A8. An
    # estimate from instruction counts (docs/quantization.md), not yet measured on an AMX host.
    AMX_MIN_M = 24

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scheme: QuantScheme,
        policy: LinearPolicy = DEFAULT_POLICY,
    ):
        """`policy`: deterministic (one order per row at every M) and bf16_tiles (LinearPolicy); its scheme is not
        read (`scheme` is this layer's)."""
        torch.nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self._setup(*quantize(weight, scheme), bias, scheme, policy)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        scheme: QuantScheme,
        bias: torch.Tensor | None = None,
        mins: torch.Tensor | None = None,
        float_output: bool = False,
        policy: LinearPolicy = DEFAULT_POLICY,
    ) -> QuantizedLinear:
        """A layer over codes, scales and optional per-group minimums already in the kernels' layout (GGUF tensors'
        own: layers/gguf_codes.py), kept as they are. float_output: float32 out whatever the input (the logits)."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.out_features = codes.shape[0]
        layer.in_features = codes.shape[1] * (8 // scheme.bits)
        layer._setup(codes, scales, bias, scheme, policy, mins, float_output)
        return layer

    def _setup(
        self, codes, scales, bias, scheme: QuantScheme, policy: LinearPolicy, mins=None, float_output: bool = False
    ) -> None:
        self.scheme, self.float_output, self.swiglu = scheme, float_output, False
        self.deterministic = policy.deterministic
        self.gemm_path = policy_gemm_path(policy) if kernels.load() is not None else None
        self.bf16_tiles = policy.bf16_tiles and not float_output  # bf16 tiles round the output to bf16
        self.group = scheme.group_for(self.in_features)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.native = self._quantized_projection()
        if self.native is not None and not kernels.load().quant_codes_kept(self.native):
            # W8A8 at every M reads only the kernel's repacked copies: the weight held once
            self.codes = self.scales = self.mins = None

    def _quantized_projection(self):
        native = kernels.load()
        if native is None:
            return None
        return native.quantized_projection(
            codes=self.codes,
            scales=self.scales,
            bits=self.scheme.bits,
            group=self.group,
            bias=self.bias,
            path=self.gemm_path,
            small_max_m=ALL_ROWS if self.deterministic else self._small_max_m(),
            float_output=self.float_output,
            mins=self.mins,
            bf16_tiles=self.bf16_tiles,
            act_block=self.ACT_BLOCK_LOGITS if self.float_output else self.ACT_BLOCK,
            **self._amx_rows(),
        )

    def _amx_rows(self) -> dict:
        """From how many rows the GEMM runs on AMX's bf16 tiles (0: never), and whether emulated: a bf16 model whose
        own GEMMs take the AMX path; never in deterministic mode (a row's result would depend on M)."""
        amx = self.bf16_tiles and not self.deterministic and kernels.bf16_gemm_on_amx()
        emulated = amx and kernels.bf16_gemm_path() == "amx_emulated"
        return {"amx_min_m": self.AMX_MIN_M if amx else 0, "amx_emulated": emulated}

    def _small_max_m(self) -> int:
        return self.SMALL_MAX_M_BF16_TILES if self.bf16_tiles else self.SMALL_MAX_M

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize(self.codes, self.scales, self.scheme.bits)
        if self.mins is not None:
            weight = weight + self.mins.repeat_interleave(self.group, dim=1)
        out = torch.nn.functional.linear(x.float(), weight, self.bias)
        return out if self.float_output else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.scheme.name}"
