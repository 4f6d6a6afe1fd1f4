"""The kernel table's choices: which path each operation of the native CPU kernels takes, from the CPU's flags, the
kernels this build compiled (the module's kernel_table(): rows of operation, data format, instruction set) and the
variables that force a path. `select_paths` is a pure function of those three, so any CPU can be tested with a fake
flag string; the layers ask kernels.attention_path() and its siblings, which call it with this process's values.

No torch here: a table and the rules that read it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

# The instruction sets, in the order of the C++ enum (isa.h Isa, bound as the module's Isa; a test holds them equal).
ISAS = ("portable", "avx2", "avx512", "avx512_bf16", "avx512_vnni", "amx")

# The /proc/cpuinfo flags each instruction set needs (isa.cpp cpu_runs asks the CPU for the same).
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "portable": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f",),
    "avx512_bf16": ("avx512f", "avx512_bf16"),
    "avx512_vnni": ("avx512f", "avx512_vnni"),
    "amx": ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile"),  # the AMX kernel's epilogue rounds with AVX512-BF16
}


@dataclass(frozen=True)
class Path:
    """One path of an operation: the instruction set of its kernel-table row (None: a library's GEMM, torch's or
    oneDNN's, which runs anywhere), and whether it is ever chosen by itself (an emulation for tests is not)."""

    name: str
    isa: str | None
    auto: bool = True


@dataclass(frozen=True)
class Operation:
    """An operation of the kernel table: its paths best first, and the variable that forces one (None: not
    forceable)."""

    name: str
    variable: str | None
    paths: tuple[Path, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.paths)

    def path(self, name: str) -> Path:
        return next(p for p in self.paths if p.name == name)


def _isa_paths(*names: str) -> tuple[Path, ...]:
    return tuple(Path(n, n) for n in names)


OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        # paged attention, decode and (AVX-512 paths) prefill: kernels.h AttentionPath
        Operation("attention", "BATCHSERVE_ATTENTION_PATH", _isa_paths("avx512_bf16", "avx512", "avx2", "portable")),
        # the native prefill kernel of a bfloat16 pool: AMX tiles (prefill_amx.cpp), AVX512-BF16 dot products on the
        # same packed K/V and key blocks (prefill_avx512_bf16.cpp), the tiles' scalar emulation (tests), or the
        # attention path's vector kernel (prefill_avx512.cpp, K/V widened to float32; a float32 pool always takes it)
        Operation(
            "prefill_attention",
            "BATCHSERVE_PREFILL_KERNEL_PATH",
            (
                Path("amx", "amx"),
                Path("avx512_bf16", "avx512_bf16"),
                Path("amx_emulated", "portable", auto=False),
                Path("avx512", "avx512"),
            ),
        ),
        # float32 GEMM of decode-sized M (small_gemm.cpp); "library": oneDNN or x @ W at every M
        Operation("small_gemm", "BATCHSERVE_SMALL_GEMM_PATH", (*_isa_paths("avx512", "avx2"), Path("library", None))),
        # bfloat16 GEMM on a CPU with bf16 matmul units: the AMX kernel, its tiles emulated (tests), bf16 pairs by
        # AVX512-BF16 for decode-sized rows (bf16_gemm.cpp: without AMX it streams a decode step's weights faster
        # than oneDNN, which takes the longer rows: layers/linear.py CpuLinear.PAIR_MAX_M), or oneDNN at every M
        Operation(
            "bf16_gemm",
            "BATCHSERVE_GEMM_PATH",
            (
                Path("amx", "amx"),
                Path("amx_emulated", "portable", auto=False),
                Path("avx512_bf16", "avx512_bf16"),
                Path("onednn", None),
            ),
        ),
        # weights kept quantized (quant_gemm.cpp; avx512_vnni: W8A8, quant_w8a8.cpp)
        Operation("quant_gemm", "BATCHSERVE_QUANT_GEMM_PATH", _isa_paths("avx512_vnni", "avx512", "avx2", "portable")),
        # a quantized KV pool's quantize-on-store and dequantize (kv_quantized.cpp)
        Operation("kv_codec", None, _isa_paths("avx512", "portable")),
        # LoRA's shrink and expand of a step's adapter groups (lora_tiles.h)
        Operation("lora", "BATCHSERVE_LORA_PATH", _isa_paths("avx512_bf16", "avx512", "avx2", "portable")),
    )
}

# Prefill attention by chunk length (layers/attention.py native_prefill_rows, kernels/step_attention.cpp): where a
# bfloat16 pool's prefill takes torch's SDPA on AMX tiles, a chunk of at most this many query rows takes the native
# prefill kernel instead, batched with the step's other short chunks: one SDPA call per sequence and layer costs more
# than its tiles save for short prompts (benchmarks/prefill_split.py; docs/cpu-kernels.md). Decided per chunk from its
# own length, so a row's path never depends on the other sequences of its step.
SHORT_PREFILL_MAX_ROWS = 128

# The head sizes for which prefill auto takes the native kernel on AMX tiles for a bfloat16 pool (else SDPA): where it
# was measured faster than torch's SDPA, one thread, 2k and 8k tokens (benchmarks/prefill_amx.py; docs/cpu-kernels.md).
AMX_PREFILL_HEAD_DIMS = (64, 128)

# CPUs that run each 512-bit vector operation as two 256-bit halves, by vendor and family (AMD family 25: Zen 4).
# There oneDNN's packed float32 GEMM beat the AVX-512 small-M kernel from 8 rows on every projection of the default
# model, narrow ones included (docs/cpu-kernels.md), so the kernel keeps only the fewest rows, and oneDNN's brgemm
# micro-kernel multiplies its panels from 4 rows (layers/linear.py CpuLinear.HALVES_UKERNEL_MAX_M).
SPLIT_AVX512_FAMILIES = {"AuthenticAMD": frozenset({"25"})}


def avx512_in_halves(vendor: str, family: str, cpu_flags: str) -> bool:
    """Whether a CPU of this vendor ("vendor_id" in /proc/cpuinfo), family ("cpu family") and flags runs AVX-512
    in two 256-bit halves (SPLIT_AVX512_FAMILIES)."""
    return "avx512f" in flag_set(cpu_flags) and family in SPLIT_AVX512_FAMILIES.get(vendor, frozenset())


FORCE_OFF = ("", "auto")  # a forcing variable with one of these values forces nothing


def flag_set(cpu_flags: str) -> frozenset[str]:
    """/proc/cpuinfo's "flags : fpu vme ..." line (or the flags alone) -> the set of flags."""
    return frozenset(cpu_flags.split(":", 1)[-1].split())


def why_not(op: str, path: str, flags: frozenset[str], built: Collection[tuple[str, str]] | None) -> str | None:
    """Why `path` of operation `op` cannot run here (None: it can): not compiled in this build (or no native kernels
    at all), or the CPU lacks a flag its instruction set needs."""
    isa = OPERATIONS[op].path(path).isa
    if isa is None:
        return None
    if built is None:
        return "the native kernels are not built here"
    if (op, isa) not in built:
        return f"this build has no {isa} kernel for it"
    missing = [f for f in ISA_FLAGS[isa] if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def select_path(
    op: str, cpu_flags: str, env: Mapping[str, str], built: Collection[tuple[str, str]] | None
) -> str | None:
    """The path operation `op` takes: the one its variable forces (ValueError naming the variable, the value and why
    it cannot run), else the first that runs and is chosen by itself; None where none runs (no native kernels)."""
    operation = OPERATIONS[op]
    flags = flag_set(cpu_flags)
    forced = env.get(operation.variable, "") if operation.variable else ""
    if forced not in FORCE_OFF:
        if forced not in operation.names:
            raise ValueError(f"{operation.variable}={forced!r}: not one of auto, {', '.join(operation.names)}")
        reason = why_not(op, forced, flags, built)
        if reason is not None:
            runnable = [p.name for p in operation.paths if why_not(op, p.name, flags, built) is None]
            raise ValueError(
                f"{operation.variable}={forced!r}: not built here or not runnable on this CPU: {reason}; runnable: "
                f"{', '.join(runnable) or 'none (native kernels off: the torch code runs)'}"
            )
        return forced
    return next((p.name for p in operation.paths if p.auto and why_not(op, p.name, flags, built) is None), None)


@dataclass(frozen=True)
class KernelPaths:
    """Each operation's chosen path (None: none runs here), and the operations whose path a variable forced."""

    paths: dict[str, str | None]
    forced: dict[str, str] = field(default_factory=dict)

    def line(self, gemm_rows: str = "") -> str:
        """The one start-up line: every operation's path, the forced ones marked with their variable."""
        parts = []
        for op, path in self.paths.items():
            mark = f" ({self.forced[op]})" if op in self.forced else ""
            parts.append(f"{op} {path or 'none'}{mark}")
        rows = f"; GEMM by rows: {gemm_rows}" if gemm_rows else ""
        return "native kernel paths: " + ", ".join(parts) + rows


def select_paths(cpu_flags: str, env: Mapping[str, str], built: Collection[tuple[str, str]] | None) -> KernelPaths:
    """Every operation's path (select_path), chosen from one CPU flag string, one environment and one build's
    table: (operation, instruction set) pairs, or None without native kernels. Raises as select_path does."""
    paths = {op: select_path(op, cpu_flags, env, built) for op in OPERATIONS}
    forced = {op: o.variable for op, o in OPERATIONS.items() if o.variable and env.get(o.variable, "") not in FORCE_OFF}
    return KernelPaths(paths, forced)


def built_pairs(rows: Collection[tuple[str, str, object]]) -> frozenset[tuple[str, str]]:
    """The module's kernel_table() rows (operation, data format, Isa) -> their (operation, instruction set) pairs."""
    return frozenset((op, isa if isinstance(isa, str) else isa.name) for op, _format, isa in rows)


NO_ROW_BOUND = 2**62  # a row-count threshold no call reaches (layers/linear.py ALL_ROWS)


@dataclass(frozen=True)
class RowSchedule:
    """The row counts at which a projection changes GEMM (kernels/layer_ops.h RowSchedule, to which it is handed):
    x @ W below small_min_m, the native small-M kernel up to small_max_m, oneDNN's brgemm micro-kernel on the same
    panels up to ukernel_max_m (0: never), oneDNN's packed GEMM below packed_max_m
    (bf16 rows padded up to packed_min_m), x @ W from there; bf16 on AMX: the AMX kernel below amx_max_m, then oneDNN;
    bf16 on AVX512-BF16 without AMX: the bf16 pair kernel below pair_max_m, then oneDNN (0: no pairs kept).
    swiglu_tile_m: a gate/up projection fused with silu_and_mul (AMX) runs its MLP in row tiles of this many.
    """

    small_min_m: int
    small_max_m: int
    packed_min_m: int
    packed_max_m: int
    amx_max_m: int
    swiglu_tile_m: int = 0
    pair_max_m: int = 0
    ukernel_max_m: int = 0

    def describe(self) -> str:
        packed = "at any M" if self.packed_max_m >= NO_ROW_BOUND else f"< {self.packed_max_m}"
        pairs = ""
        if self.pair_max_m:
            pairs = ", bf16 pairs at any M" if self.pair_max_m >= NO_ROW_BOUND else f", bf16 pairs < {self.pair_max_m}"
        ukernel = f", oneDNN brgemm on its panels ..{self.ukernel_max_m}" if self.ukernel_max_m else ""
        return (
            f"small-M kernel {self.small_min_m}..{self.small_max_m}{ukernel}, oneDNN packed {packed} "
            f"(padded to {self.packed_min_m}), AMX < {self.amx_max_m}{pairs}"
        )


# ---- quantization auto: a GGUF file's codes as stored, or dequantized --------------------------------------------------

# The one rule of quantization auto (docs/quantization.md#quantization-auto). A GGUF file's codes run as stored only on
# a weight-only path of the quantized GEMM (the activations stay bf16), never W8A8 (avx512_vnni): W8A8 was faster but
# its int8 activations changed the default model's greedy answer to the README's chat example. Per weight-only path
# and the CPU flag of a host class: whether as stored was measured faster than the same file dequantized in bf16
# (single stream and peer64 on the default model, alternating in one process), and what was measured. A path or
# class not in the table is not measured: dequantized there.
WEIGHT_ONLY_PATHS = ("avx512", "avx2")  # best first
AS_STORED_MEASURED: dict[tuple[str, str], tuple[bool, str]] = {
    ("avx512", "amx_bf16"): (
        False,
        "weight-only, measured slower than the dequantized bf16 GEMMs on peer64 on the AMX class "
        "(its decode rows widen the codes in registers where the bf16 model's take AMX)",
    ),
}
AS_STORED_DTYPES = ("bfloat16",)  # float32 is the exactness reference (transformers' tokens); float16 not measured
BF16_UNIT_FLAGS = ("amx_bf16", "avx512_bf16")
W8A8_PATHS = ("avx512_vnni",)


@dataclass(frozen=True)
class StoredChoice:
    """quantization auto's answer for a GGUF file the as-stored kernels take: run its codes as stored (on
    quant_gemm_path), and why."""

    as_stored: bool
    reason: str
    quant_gemm_path: str | None = None


def gguf_as_stored_rule(
    dtype: str, cpu_flags: str, env: Mapping[str, str], built: Collection[tuple[str, str]] | None
) -> StoredChoice:
    """Whether quantization auto runs a GGUF file's codes as stored in `dtype` ("bfloat16", "float32", ...) on this
    CPU, build and environment, and on which weight-only path (a forced path counts; ValueError where it cannot
    run)."""
    if dtype not in AS_STORED_DTYPES:
        why = "the exactness reference" if dtype == "float32" else "as stored not measured against it"
        return StoredChoice(False, f"dtype {dtype}: {why}")
    flags = flag_set(cpu_flags)
    if not any(flag in flags for flag in BF16_UNIT_FLAGS):
        return StoredChoice(False, "no bf16 matmul units on this CPU: as stored not measured against bf16 here")
    path, why_none = weight_only_path(cpu_flags, env, built)
    if path is None:
        return StoredChoice(False, why_none)
    measured = [found for (on, flag), found in AS_STORED_MEASURED.items() if on == path and flag in flags]
    if not measured:
        return StoredChoice(False, f"quantized GEMM path {path}: not measured against the dequantized model here")
    faster, what = measured[0]
    return StoredChoice(faster, f"quantized GEMM path {path}: {what}", path if faster else None)


def weight_only_path(
    cpu_flags: str, env: Mapping[str, str], built: Collection[tuple[str, str]] | None
) -> tuple[str | None, str]:
    """The quantized GEMM path quantization auto would run a file as stored on: a forced one unless it is W8A8, else
    the best weight-only path that runs here -> (path, why none)."""
    operation = OPERATIONS["quant_gemm"]
    if env.get(operation.variable, "") not in FORCE_OFF:
        forced = select_path("quant_gemm", cpu_flags, env, built)
        if forced in W8A8_PATHS:
            return None, f"quantized GEMM path {forced} (W8A8): int8 activations, which quantization auto never picks"
        return forced, ""
    flags = flag_set(cpu_flags)
    path = next((p for p in WEIGHT_ONLY_PATHS if why_not("quant_gemm", p, flags, built) is None), None)
    return path, "no native weight-only quantized GEMM here"
