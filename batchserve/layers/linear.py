"""CpuLinear: a projection laid out for this CPU's GEMMs (native small-M, AMX or bf16 pair kernel, oneDNN packed, or
x @ W)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from batchserve.host.huge_pages import HugePageArena
from batchserve.layers import kernels
from batchserve.layers.kernels.paths import NO_ROW_BOUND, RowSchedule

if TYPE_CHECKING:
    from batchserve.layers.quantization import QuantScheme

logger = logging.getLogger(__name__)

ALL_ROWS = NO_ROW_BOUND  # a row-count threshold no batch reaches


@dataclass(frozen=True)
class LinearPolicy:
    """How projections are laid out, handed to each layer's constructor (CpuLinear, QuantizedLinear): nothing about
    it is read from ambient state there.

    deterministic: one GEMM for every M whose order per row is fixed (docs/determinism.md); scheme: the decoder
    layers' projections kept quantized in it (None: not; quantization.parse_quantization); gguf_as_stored: a GGUF
    file's quantized tensors run as stored; bf16_tiles: a bfloat16 model on a CPU with bf16 units, whose quantized
    GEMM of many rows multiplies dequantized bf16 tiles; quant_gemm_path: the quantized GEMM's path ("avx512",
    "avx512_vnni", ...: kernels/paths.py OPERATIONS), None for the kernel table's choice (a forced
    BATCHSERVE_QUANT_GEMM_PATH wins over either). max_rows: the most rows one call carries (the engine's
    max_num_tokens; None: no bound): a layout that only longer calls would read is not kept, each layout being a whole
    copy of the weight. one_bf16_copy: a bf16 projection on the pair kernel keeps the pairs alone, for every M, and no
    oneDNN copy for the longer rows (a speculating engine, or a model too large for two copies: keeps_one_bf16_copy)."""

    deterministic: bool = False
    scheme: QuantScheme | None = None
    gguf_as_stored: bool = False
    bf16_tiles: bool = False
    quant_gemm_path: str | None = None
    max_rows: int | None = None
    one_bf16_copy: bool = False


DEFAULT_POLICY = LinearPolicy()

# The policy of the model being loaded, for the model code that lays out its projections without being handed one
# (CpuLinear.from_linear; engine/startup.py sets it around load_model). Read by loading_policy() only, never by a
# constructor.
_loading = contextvars.ContextVar("linear_policy", default=DEFAULT_POLICY)


def loading_policy() -> LinearPolicy:
    """The policy of the model being loaded (layout_policy), DEFAULT_POLICY outside one."""
    return _loading.get()


@contextlib.contextmanager
def layout_policy(policy: LinearPolicy):
    """Inside, loading_policy() is `policy`: the model's layout code hands it to the projections it builds."""
    token = _loading.set(policy)
    try:
        yield policy
    finally:
        _loading.reset(token)


@contextlib.contextmanager
def engine_layouts(deterministic: bool, max_rows: int | None, one_bf16_copy: bool = False):
    """The loading policy of an engine's model: deterministic GEMMs or not (deterministic_gemms), `max_rows`, the
    most rows one forward pass carries (max_num_tokens), past which no layout is kept (LinearPolicy.max_rows), and
    whether bf16 weights on the pair kernel keep one copy (LinearPolicy.one_bf16_copy)."""
    with deterministic_gemms(deterministic) as policy:
        with layout_policy(dataclasses.replace(policy, max_rows=max_rows, one_bf16_copy=one_bf16_copy)):
            yield loading_policy()


# Where the pair kernel's rows are split from oneDNN's (CpuLinear.PAIR_MAX_M below ALL_ROWS), a bf16 model keeps
# oneDNN's copy of each projection beside the pairs only where its weights take at most this share of the memory free
# at load: the second copy then still leaves at least half of that memory to the KV pool. A larger model
# (Llama-3.1-8B's 16 GB on a 24 GiB host) keeps the pairs alone and runs them at every M: its prefill a few percent
# slower than oneDNN's (docs/cpu-kernels.md), its decode as fast.
SECOND_BF16_COPY_MAX_SHARE = 0.25


def keeps_one_bf16_copy(weight_bytes: int, available_bytes: int, dtype: torch.dtype, speculating: bool = False) -> bool:
    """Whether a CPU model of `weight_bytes` in `dtype`, loaded with `available_bytes` free, keeps its projections in
    the pair kernel's layout alone, taken at every M (LinearPolicy.one_bf16_copy): bf16 on the pair path split by
    rows (CpuLinear.PAIR_MAX_M), and a second copy would take more than SECOND_BF16_COPY_MAX_SHARE of the memory, or
    the engine speculates (a verify step must round each row as the plain decode does, whatever its row count). Said
    in the log where so."""
    if CpuLinear.PAIR_MAX_M >= ALL_ROWS:
        return False  # the pairs take every M: one copy anyway
    if dtype != torch.bfloat16 or kernels.load() is None or not kernels.has_matmul_units(dtype):
        return False
    if kernels.bf16_gemm_path() != "avx512_bf16":
        return False
    if speculating:
        logger.info("bf16 pair kernel at every M, one copy: speculation's verify steps round each row as plain decodes")
        return True
    if weight_bytes <= available_bytes * SECOND_BF16_COPY_MAX_SHARE:
        return False
    logger.info(
        "bf16 weights (%.1f GiB) kept in the pair kernel's layout alone, taken at every M: oneDNN's copy for the "
        "longer rows would take more than %d%% of the memory free (%.1f GiB)",
        weight_bytes / 2**30,
        round(SECOND_BF16_COPY_MAX_SHARE * 100),
        available_bytes / 2**30,
    )
    return True


@contextlib.contextmanager
def deterministic_gemms(on: bool = True):
    """The loading policy with `deterministic` = on: projections laid out inside compute each output row in one
    reduction order, whatever the number of rows and the row's position: one kernel for every M whose order is fixed
    (bf16_gemm on AVX512-BF16, the small-M float32 kernel otherwise), never the libraries' GEMMs, whose blocking
    follows M."""
    with layout_policy(dataclasses.replace(loading_policy(), deterministic=on)) as policy:
        yield policy


class CpuLinear(nn.Module):
    """A Linear laid out for this CPU's GEMMs, picked per call by the number of rows M (measured, see
    benchmarks/roofline.py and docs/cpu-kernels.md): the native AMX kernel for bf16 on AMX, the native small-M
    kernel (weight packed in panels of two vectors' width) for decode-sized float32 M, oneDNN with a pre-packed weight
    for the wide projections (gate/up, lm_head) up to prefill-sized M, a plain [in, out] weight (x @ W) otherwise. Each
    layout is a copy of the weight: memory traded for speed. The choice by rows is made in one place, the native
    Projection (kernels/projection.cpp) this layer holds and calls, which the native decoder loop calls too; without
    the native kernels the torch code runs (oneDNN packed or x @ W)."""

    # from where the native kernel wins, per path: on AVX-512 one row streams the weight fastest as x @ W; on AVX2 the
    # kernel streams it faster than x @ W even then
    SMALL_MIN_M = {"avx512": 2, "avx2": 1, "library": 2}
    # up to where the native kernel wins, per path: {narrow projection?: M} (on AVX2 the 8-wide kernel runs near the
    # FMA peak and beats oneDNN and x @ W well into prefill-sized M)
    SMALL_MAX_M = {"avx512": {False: 48, True: 64}, "avx2": {False: 256, True: 384}, "library": {False: 0, True: 0}}
    # on a CPU that runs AVX-512 in two halves (kernels.avx512_in_halves: AMD family 25) oneDNN's packed GEMM beat the
    # avx512 kernel from 8 rows on every projection, narrow ones too, and x @ W at every M up to 2,048 (one thread, CPU
    # clock: docs/cpu-kernels.md); there the kernel keeps fewer rows, every projection keeps oneDNN's copy and x @ W
    # is left only one row
    HALVES_SMALL_MAX_M = 3
    # ... and from 4 rows to this many oneDNN's brgemm micro-kernel on the small-M kernel's panels
    # (kernels/panel_brgemm.cpp) ran every projection of the default model faster than oneDNN's packed GEMM on two
    # threads (busiest thread, CPU clock: benchmarks/gemm_threads.py, docs/cpu-kernels.md): the same inner code,
    # panels split evenly over the threads and no per-call set-up
    HALVES_UKERNEL_MAX_M = 128
    # but on a vocabulary-sized output projection (more columns than VOCAB_OUT) oneDNN's blocking won from 40 rows
    HALVES_VOCAB_UKERNEL_MAX_M = 24
    VOCAB_OUT = 16384
    # oneDNN's bf16 GEMM runs fewer than 4 rows slower than 4: zero rows pad up to 4
    PACKED_MIN_M = 4
    PACKED_MAX_M = 512  # from here on (prefill chunks) x @ W is as fast
    # bf16 on AMX: the native AMX kernel below this M, oneDNN's packed GEMM from here on (where oneDNN's cache blocking
    # starts to win)
    AMX_MAX_M = 1280
    # bf16 on AVX512-BF16 without AMX: the bf16 pair kernel below this M, oneDNN's packed GEMM (a second copy of the
    # weight) from here on. On the EPYC of family 25 the pairs ran every projection of the default model 1.1-1.7x as
    # fast as oneDNN up to 20 rows, about even at 24, gate/up behind from 32 (benchmarks/gemm_by_rows.py --dtype
    # bfloat16; docs/cpu-kernels.md); at every M they made prefill and peer64 4-9% slower. A split by rows makes a
    # row's rounding follow how many rows its step carries, so a speculating engine keeps the pairs alone
    # (keeps_one_bf16_copy): its verified drafts then round as plain decodes (tests/engine/test_speculative.py).
    PAIR_MAX_M = 24
    # bf16 on AMX: the MLP of a longer step in row tiles of this many (kernels/projection.cpp swiglu_mlp); 256 ran it
    # fastest of 128-1024 at 4,096 rows on one core
    SWIGLU_TILE_M = 256
    NARROW_OUT = 1024  # qkv, o and down: x @ W is as fast as oneDNN's packed kernel

    @classmethod
    def row_schedule_for(
        cls, small_path: str, narrow: bool = False, halves: bool = False, pairs: bool = False, vocab: bool = False
    ) -> RowSchedule:
        """The row counts at which a projection on small-M path `small_path` changes GEMM (this class's thresholds,
        read when a layer is built, so that a test may move one); `halves`: the CPU runs AVX-512 in two halves;
        `pairs`: a bf16 projection that keeps the pair kernel's layout beside oneDNN's; `vocab`: more output columns
        than VOCAB_OUT."""
        small_max_m, packed_max_m = cls.SMALL_MAX_M[small_path][narrow], cls.PACKED_MAX_M
        ukernel_max_m = 0
        if halves and small_path == "avx512":
            small_max_m, packed_max_m = min(small_max_m, cls.HALVES_SMALL_MAX_M), ALL_ROWS
            ukernel_max_m = cls.HALVES_VOCAB_UKERNEL_MAX_M if vocab else cls.HALVES_UKERNEL_MAX_M
        return RowSchedule(
            small_min_m=cls.SMALL_MIN_M[small_path],
            small_max_m=small_max_m,
            packed_min_m=cls.PACKED_MIN_M,
            packed_max_m=packed_max_m,
            amx_max_m=cls.AMX_MAX_M,
            swiglu_tile_m=cls.SWIGLU_TILE_M,
            pair_max_m=cls.PAIR_MAX_M if pairs else 0,
            ukernel_max_m=ukernel_max_m,
        )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        swiglu: bool = False,
        float_output: bool = False,
        policy: LinearPolicy = DEFAULT_POLICY,
    ):
        """`swiglu`: a gate/up projection (gate rows, then as many up rows) that MLP reads through `silu_and_mul`:
        on the AMX path its panels interleave the two, so that the kernel writes silu(gate) * up itself.
        `float_output`: the result is the GEMM's float32 accumulator, never rounded to the model's dtype (the output
        projection: rounded logits make ties). `policy.deterministic`: one GEMM serves every M."""
        super().__init__()
        self.out_features = weight.shape[0]
        self.float_output = float_output
        self.deterministic = policy.deterministic
        weight = weight.detach()
        low_precision = weight.dtype in (torch.bfloat16, torch.float16)
        # With bf16/fp16 matmul units (AMX, AVX512-BF16) oneDNN's GEMM on a pre-packed weight runs faster than
        # torch.matmul in that dtype at every M: one path for all.
        self.packed_only = low_precision and kernels.has_matmul_units(weight.dtype)
        # bf16 pairs by AVX512-BF16: at every M for a float32 result in one order per row (deterministic mode,
        # logits) or where the policy keeps one copy; where they are the bf16 GEMM path (AVX512-BF16 without AMX),
        # for the rows below PAIR_MAX_M, beside oneDNN's copy for the longer ones
        one_order = self.deterministic or float_output
        pairs_path = weight.dtype == torch.bfloat16 and kernels.bf16_gemm_path() == "avx512_bf16"
        self.bf16_pairs = (one_order or pairs_path) and self._bf16_gemm_runs(weight)
        if self.bf16_pairs and (one_order or self._pairs_alone(policy)):
            self._init_bf16_pairs(weight, bias)
            return
        if low_precision and (self.deterministic or float_output):
            # no bf16 kernel with a float32 result or a fixed order here: the float32 GEMMs on a widened copy give both
            self.packed_only = False
        if low_precision and not self.packed_only:
            # Without bf16/fp16 matmul units torch's GEMM in them runs far slower than float32's. A product of two bf16
            # (or fp16) values is exact in float32, so a float32 GEMM on widened copies, its result rounded back, is
            # what a bf16 GEMM with float32 accumulation computes, in another summation order.
            weight = weight.float()
            bias = None if bias is None else bias.float()
        self.gemm_dtype = weight.dtype
        self.register_buffer("bias", None if bias is None else bias.detach())
        narrow = self.out_features <= self.NARROW_OUT
        small_path = kernels.small_gemm_path() if kernels.for_tensors(weight) is not None else "library"
        halves = small_path == "avx512" and kernels.avx512_in_halves()
        path = self._amx_path(weight)
        # bf16 on AMX hands rows from AMX_MAX_M on to oneDNN's packed copy; where no call carries that many rows
        # the AMX kernel takes every M and that copy (the size of the weight) is not made
        amx_takes_all = path is not None and policy.max_rows is not None and policy.max_rows < self.AMX_MAX_M
        keep_packed = not (narrow and not self.packed_only and not halves) and not amx_takes_all
        self.register_buffer("packed", _mkldnn_pack(weight) if keep_packed else None)
        self.packed_only = self.packed_only and (self.packed is not None or amx_takes_all)
        path = path if self.packed_only else None
        # [in, out] for x @ W, which the packed-only path never runs: not kept there (a whole weight's copy less)
        self.register_buffer("weight_t", None if self.packed_only else _streamed(weight.t()))
        vocab = self.out_features > self.VOCAB_OUT
        self.rows = self.row_schedule_for(small_path, narrow, halves, pairs=self.bf16_pairs, vocab=vocab)
        small = small_path != "library"
        if self.deterministic:
            # the small-M kernel's order is one per row at any M (threads split columns, K runs in one order); without
            # it x @ W serves every M (the library's order, not guaranteed: the start-up log says so)
            small_min_m, small_max_m = (1, ALL_ROWS) if small else (ALL_ROWS, 0)
            self.rows = dataclasses.replace(self.rows, small_min_m=small_min_m, small_max_m=small_max_m)
            self.register_buffer("packed", None)
        if amx_takes_all:
            self.rows = dataclasses.replace(self.rows, amx_max_m=ALL_ROWS)
        self.register_buffer(
            "small_packed",
            _packed_streamed(kernels.load().small_gemm_pack(weight, small_path) if small else None, weight),
        )
        self.amx_emulated = path == "amx_emulated"
        self.swiglu = swiglu and path is not None and bias is None
        self.register_buffer(
            "amx_packed", _packed_streamed(self._amx_layout(weight) if path is not None else None, weight)
        )
        pairs = kernels.load().bf16_gemm_pack(weight.contiguous()) if self.bf16_pairs else None
        self.register_buffer("bf16_packed", _packed_streamed(pairs, weight))
        self.native = self._native_projection()

    def _pairs_alone(self, policy: LinearPolicy) -> bool:
        """Whether the pair kernel takes every M, no oneDNN copy kept: no split by rows, the policy keeps one copy, or
        no call carries the rows oneDNN would take."""
        reach_onednn = self.PAIR_MAX_M < ALL_ROWS and (policy.max_rows is None or policy.max_rows >= self.PAIR_MAX_M)
        return policy.one_bf16_copy or not reach_onednn

    @staticmethod
    def _bf16_gemm_runs(weight: torch.Tensor) -> bool:
        native = kernels.load()
        return (
            weight.dtype == torch.bfloat16
            and kernels.has_matmul_units(weight.dtype)
            and native is not None
            and native.bf16_gemm_available()
        )

    def _init_bf16_pairs(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """The layout of bf16_gemm alone: one kernel at every M, its float32 result rounded to bf16 unless
        float_output (no oneDNN, AMX or [in, out] copy: never read)."""
        self.packed_only, self.amx_emulated, self.swiglu = False, False, False
        self.gemm_dtype = weight.dtype
        self.rows = dataclasses.replace(self.row_schedule_for("library"), small_min_m=ALL_ROWS, small_max_m=0)
        self.register_buffer("bias", None if bias is None else bias.detach())
        for name in ("packed", "weight_t", "small_packed", "amx_packed"):
            self.register_buffer(name, None)
        self.register_buffer(
            "bf16_packed", _packed_streamed(kernels.load().bf16_gemm_pack(weight.contiguous()), weight)
        )
        self.native = self._native_projection()

    def _amx_path(self, weight: torch.Tensor) -> str | None:
        """This CPU's bf16 GEMM path ("amx" or "amx_emulated") where it is the AMX kernel and the kernel takes the
        weight's shape; else None (deterministic mode: the AMX kernel hands large M to oneDNN)."""
        if not self.packed_only or weight.dtype != torch.bfloat16 or self.deterministic:
            return None
        path = kernels.bf16_gemm_path()
        native = kernels.load()
        if not kernels.bf16_gemm_on_amx() or native is None or not native.amx_gemm_takes(*weight.shape):
            return None
        return path

    def _amx_layout(self, weight: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            weight = swiglu_interleaved(weight)
        return kernels.load().amx_gemm_pack(weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, swiglu: bool = False, policy: LinearPolicy | None = None) -> CpuLinear:
        """The layout of a decoder layer's projection under `policy` (default: the loading policy, for the model code
        that is not handed one): kept quantized where it has a scheme."""
        from batchserve.layers import quantization  # it builds on this module

        if isinstance(linear, quantization.QuantizedLinear):
            return linear  # laid out already: a GGUF file's own codes (quantization gguf)
        policy = loading_policy() if policy is None else policy
        if policy.scheme is not None:
            return quantization.QuantizedLinear(linear.weight, linear.bias, policy.scheme, policy)
        return cls(linear.weight, linear.bias, swiglu=swiglu, policy=policy)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up projection's output [M, 2I] -> [M, I]: one AMX call where it takes the
        rows (bit for bit the unfused result), else the GEMM and then the native silu_and_mul."""
        if self.native is not None and x.dtype in kernels.FUSED_DTYPES:
            return self.native.silu_and_mul(x)
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native(x)
        return self._torch_forward(x)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Without the native kernels: oneDNN's GEMM on the packed copy where there is one, else x @ W."""
        y = x.to(self.gemm_dtype)
        dtype = torch.float32 if self.float_output else x.dtype
        if self.packed is not None:
            return self._packed(y).to(dtype)
        out = torch.matmul(y, self.weight_t)
        return (out if self.bias is None else out + self.bias).to(dtype)

    def _native_projection(self):
        """This projection's layouts and thresholds as the native Projection that picks the GEMM by rows, or None
        where the native kernels are not built."""
        native = kernels.load()
        if native is None:
            return None
        return native.Projection(
            # packed-only: no [in, out] copy, only its dtype (the GEMM's) is read
            weight_t=self.weight_t if self.weight_t is not None else torch.empty(0, dtype=self.gemm_dtype),
            bias=self.bias,
            packed=self.packed,
            small_packed=self.small_packed,
            out_features=self.out_features,
            rows=native.RowSchedule(**dataclasses.asdict(self.rows)),
            packed_only=self.packed_only,
            amx_packed=self.amx_packed,
            amx_emulated=self.amx_emulated,
            swiglu=self.swiglu,
            bf16_packed=self.bf16_packed,
            float_output=self.float_output,
        )

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def swiglu_interleaved(weight: torch.Tensor) -> torch.Tensor:
    """A gate/up weight [2I, K] (gate rows, then up rows) reordered so that each AMX panel of 32 rows holds 16 gate
    rows and the same 16 up rows: the order amx_gemm(swiglu=True) takes."""
    inter = weight.shape[0] // 2
    half = kernels.AMX_PANEL // 2
    return weight.reshape(2, inter // half, half, -1).transpose(0, 1).reshape(weight.shape).contiguous()


# The layouts our GEMMs stream whole at each decode step, side by side on 2 MiB pages (a projection of the default model
# is 0.2-3.5 MB: too small for a mapping of its own). oneDNN's packed copy stays where oneDNN puts it.
_STREAMED_WEIGHTS = HugePageArena()


def _streamed(layout: torch.Tensor | None) -> torch.Tensor | None:
    """`layout` copied onto 2 MiB pages where the host allows (contiguous either way)."""
    return None if layout is None else _STREAMED_WEIGHTS.copy(layout)


def _packed_streamed(packed: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor | None:
    """A packer's output for `weight` onto 2 MiB pages where the host allows; elsewhere kept as the packer made it,
    not cloned, unless it shares the weight's memory (a packing that changed nothing) and so must still be a copy."""
    if packed is None:
        return None
    if packed.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        return _STREAMED_WEIGHTS.copy(packed)
    return _STREAMED_WEIGHTS.place(packed)


def _mkldnn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a weight, or None where this torch build has no oneDNN linear for its dtype."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (AttributeError, RuntimeError):
        return None


def gemm_path(dtype: torch.dtype) -> str:
    """The GEMM path CpuLinear takes for a model in `dtype` on this CPU, in words (the start-up log says it)."""
    if dtype in (torch.bfloat16, torch.float16):
        if kernels.has_matmul_units(dtype):
            if dtype == torch.bfloat16 and kernels.bf16_gemm_path() == "avx512_bf16" and kernels.load() is not None:
                if CpuLinear.PAIR_MAX_M >= ALL_ROWS:
                    return "the native bf16 pair kernel (avx512_bf16) at every M, on weights packed once"
                return (
                    f"the native bf16 pair kernel (avx512_bf16) below {CpuLinear.PAIR_MAX_M} rows, oneDNN bf16 GEMMs "
                    "from there (the pairs at every M where the model keeps one copy), on weights packed once"
                )
            amx = dtype == torch.bfloat16 and kernels.bf16_gemm_on_amx()
            first = (
                f"the native AMX kernel ({kernels.bf16_gemm_path()}) below {CpuLinear.AMX_MAX_M} rows, " if amx else ""
            )
            return f"{first}oneDNN {dtype} GEMMs on weights packed once ({dtype} matmul units)"
        return f"float32 GEMMs on widened weights (no {dtype} matmul units)"
    small = kernels.small_gemm_path() if kernels.load() is not None else "library"
    if small != "library":
        return f"float32 GEMMs: native small-M kernel ({small}), oneDNN packed or x @ W, by rows"
    return "float32 GEMMs: oneDNN packed or x @ W, by rows (the native small-M kernel needs AVX2 + FMA)"


def deterministic_gemm_path(dtype: torch.dtype) -> str:
    """The one GEMM deterministic mode runs for a model in `dtype` on this CPU, in words (the start-up log says it)."""
    native = kernels.load()
    if dtype == torch.bfloat16 and kernels.has_matmul_units(dtype) and native and native.bf16_gemm_available():
        return "bf16_gemm (AVX512-BF16 pairs, one order per row) at every M"
    small = kernels.small_gemm_path() if native is not None else "library"
    widened = " on widened weights" if dtype != torch.float32 else ""
    if small != "library":
        return f"float32 small-M kernel ({small}){widened} at every M (one order per row)"
    return f"x @ W{widened} at every M: the library's GEMM, whose order per row is NOT guaranteed fixed"
