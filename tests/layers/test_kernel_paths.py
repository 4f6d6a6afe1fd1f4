"""The kernel table (layers/kernels/paths.py): each operation's path from a CPU's flags, a build's table and the
forcing variables, as a pure function (fake flag strings stand for other CPUs), and the same table and enum as the
C++ side has them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from batchserve.layers import kernels
from batchserve.layers.kernels import build, paths
from batchserve.layers.kernels.paths import ISAS, OPERATIONS, select_path, select_paths

ZEN3 = "flags : fpu sse2 avx f16c fma avx2 bmi2"
SKYLAKE_SP = ZEN3 + " avx512f avx512bw avx512vl avx512_vnni"
ZEN4 = SKYLAKE_SP + " avx512_bf16"  # no AMX
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8"
OLD = "flags : fpu sse2 sse4_2"


def _everything_built() -> frozenset[tuple[str, str]]:
    """A build on a CPU with every instruction set: a row for each path of each operation."""
    return frozenset((op.name, p.isa) for op in OPERATIONS.values() for p in op.paths if p.isa is not None)


def _built_on(flags: str) -> frozenset[tuple[str, str]]:
    """What a -march=native build on `flags`' CPU compiles: the rows whose instruction set that CPU has, except
    that any AVX-512 build compiles the avx512_bf16 functions (per-function target) and AMX's (isa.h); the bf16
    dot-product prefill kernel is a whole file for that target, compiled only where the CPU has it."""
    have = paths.flag_set(flags)
    avx512 = "avx512f" in have

    def compiled(op: str, isa: str) -> bool:
        if isa in ("avx512_bf16", "amx") and (op, isa) != ("prefill_attention", "avx512_bf16"):
            return avx512
        return all(f in have for f in paths.ISA_FLAGS[isa])

    return frozenset(row for row in _everything_built() if compiled(*row))


@pytest.mark.parametrize(
    "flags, expected",
    [
        (SAPPHIRE_RAPIDS, {"attention": "avx512_bf16", "small_gemm": "avx512", "bf16_gemm": "amx",
                           "quant_gemm": "avx512_vnni", "kv_codec": "avx512", "lora": "avx512_bf16",
                           "prefill_attention": "amx"}),
        (ZEN4, {"attention": "avx512_bf16", "small_gemm": "avx512", "bf16_gemm": "avx512_bf16",
                "quant_gemm": "avx512_vnni", "kv_codec": "avx512", "lora": "avx512_bf16",
                "prefill_attention": "avx512_bf16"}),
        (SKYLAKE_SP, {"attention": "avx512", "small_gemm": "avx512", "bf16_gemm": "onednn",
                      "quant_gemm": "avx512_vnni", "kv_codec": "avx512", "lora": "avx512",
                      "prefill_attention": "avx512"}),
        (ZEN3, {"attention": "avx2", "small_gemm": "avx2", "bf16_gemm": "onednn", "quant_gemm": "avx2",
                "kv_codec": "portable", "lora": "avx2", "prefill_attention": None}),
        (OLD, {"attention": "portable", "small_gemm": "library", "bf16_gemm": "onednn", "quant_gemm": "portable",
               "kv_codec": "portable", "lora": "portable", "prefill_attention": None}),
    ],
    ids=["sapphire-rapids", "zen4", "skylake-sp", "zen3", "no-avx2"],
)  # fmt: skip
def test_each_cpu_gets_the_best_path_it_runs(flags, expected):
    chosen = select_paths(flags, {}, _built_on(flags))
    assert chosen.paths == expected and chosen.forced == {}


def test_a_build_from_another_cpu_is_read_against_this_cpus_flags():
    """A table with every row (an AVX-512 build) on a CPU without AVX-512 (a library moved, or emulation): the flags
    rule out what the CPU lacks."""
    assert select_paths(ZEN3, {}, _everything_built()).paths["attention"] == "avx2"


def test_without_native_kernels_only_the_libraries_paths_run():
    chosen = select_paths(SAPPHIRE_RAPIDS, {}, None)
    assert chosen.paths == {"attention": None, "small_gemm": "library", "bf16_gemm": "onednn", "quant_gemm": None,
                            "kv_codec": None, "lora": None, "prefill_attention": None}  # fmt: skip


def test_the_emulated_amx_path_is_taken_only_when_forced():
    built = _built_on(ZEN3)
    assert select_path("bf16_gemm", ZEN3, {}, built) == "onednn"
    assert select_path("bf16_gemm", ZEN3, {"BATCHSERVE_GEMM_PATH": "amx_emulated"}, built) == "amx_emulated"


def test_the_bf16_pair_gemm_is_taken_with_avx512_bf16_and_no_amx():
    built = _built_on(ZEN4)
    assert select_path("bf16_gemm", ZEN4, {}, built) == "avx512_bf16"
    assert select_path("bf16_gemm", ZEN4, {"BATCHSERVE_GEMM_PATH": "onednn"}, built) == "onednn"
    assert select_path("bf16_gemm", SAPPHIRE_RAPIDS, {}, _built_on(SAPPHIRE_RAPIDS)) == "amx"  # AMX first
    assert select_path("bf16_gemm", SKYLAKE_SP, {}, _built_on(SKYLAKE_SP)) == "onednn"  # no vdpbf16ps
    with pytest.raises(ValueError):
        select_path("bf16_gemm", SKYLAKE_SP, {"BATCHSERVE_GEMM_PATH": "avx512_bf16"}, _built_on(SKYLAKE_SP))


@pytest.mark.parametrize("op", [op for op in OPERATIONS.values() if op.variable], ids=lambda op: op.name)
def test_a_forced_path_goes_through_the_table_and_fails_loudly_where_it_cannot_run(op):
    built = _built_on(OLD)
    for path in op.paths:
        env = {op.variable: path.name}
        runs = paths.why_not(op.name, path.name, paths.flag_set(OLD), built) is None
        if runs:
            assert select_path(op.name, OLD, env, built) == path.name
            assert select_paths(OLD, env, built).forced == {op.name: op.variable}
        else:
            with pytest.raises(ValueError, match=f"{op.variable}='{path.name}': not built here or not runnable"):
                select_path(op.name, OLD, env, built)
    with pytest.raises(ValueError, match=f"{op.variable}='sse9': not one of auto, "):
        select_path(op.name, OLD, {op.variable: "sse9"}, built)
    for off in ("", "auto"):
        assert select_path(op.name, OLD, {op.variable: off}, built) == select_path(op.name, OLD, {}, built)


def test_the_reason_names_the_missing_flags():
    built = _everything_built()
    with pytest.raises(
        ValueError, match=r"the CPU lacks avx512_bf16, amx_bf16, amx_tile; runnable: amx_emulated, onednn"
    ):
        select_path("bf16_gemm", SKYLAKE_SP, {"BATCHSERVE_GEMM_PATH": "amx"}, built)


def test_the_start_up_line_names_every_operation_and_the_forced_ones():
    chosen = select_paths(ZEN3, {"BATCHSERVE_ATTENTION_PATH": "portable"}, _built_on(ZEN3))
    line = chosen.line("small-M kernel 1..256")
    assert "\n" not in line
    assert "attention portable (BATCHSERVE_ATTENTION_PATH)" in line and "small_gemm avx2," in line
    assert all(op in line for op in OPERATIONS) and line.endswith("GEMM by rows: small-M kernel 1..256")


def test_only_the_instruction_sets_this_cpu_runs_are_compiled(tmp_path):
    names = ("decode_avx512.cpp", "decode_avx2.cpp", "bindings.cpp", "fused_ops.cpp", "lora_kernels_avx512.cpp")
    sources = [tmp_path / n for n in names]
    assert [p.name for p in build.sources_for(sources, ZEN3)] == ["bindings.cpp", "decode_avx2.cpp", "fused_ops.cpp"]
    kept = build.sources_for(sources, SKYLAKE_SP)
    assert kept[0].name == "bindings.cpp" and {p.name for p in kept} == {p.name for p in sources}


def test_the_costliest_sources_are_handed_to_the_build_tool_first_then_the_rest_by_name(tmp_path):
    names = ("amx_gemm.cpp", "decode_avx2.cpp", "zz_new.cpp", "lora_kernels_portable.cpp", "bindings.cpp")
    ordered = [p.name for p in build.sources_for([tmp_path / n for n in names], SKYLAKE_SP)]
    assert ordered == ["bindings.cpp", "lora_kernels_portable.cpp", "decode_avx2.cpp", "amx_gemm.cpp", "zz_new.cpp"]


def test_every_source_named_by_the_build_exists():
    """A renamed or split kernel file must not leave the build's lists naming a file no longer there (it would then
    compile on every CPU, or lose its place at the front)."""
    here = {p.name for p in Path(kernels.__file__).parent.glob("*.cpp")}
    assert set(build.ISA_ONLY_SOURCES) <= here and set(build.COSTLIEST_FIRST) <= here


# ---- the C++ side: the same enum, the same table -----------------------------------------------------------------


@pytest.fixture
def native():
    module = kernels.load()
    if module is None:
        pytest.skip("native kernels cannot be built here")
    return module


def test_python_and_cpp_share_one_isa_enum(native):
    assert list(native.Isa.__members__) == list(ISAS)
    assert [int(v) for v in native.Isa.__members__.values()] == list(range(len(ISAS)))
    assert native.AttentionPath is native.Isa  # an attention path is an instruction set


def test_the_cpp_table_and_cpu_check_agree_with_the_flags(native):
    flags = paths.flag_set(kernels.cpu_flags())
    for isa in ISAS:
        if isa != "amx":  # AMX also needs the kernel to grant the tiles
            assert native.cpu_runs(native.Isa.__members__[isa]) == all(f in flags for f in paths.ISA_FLAGS[isa]), isa
    built = paths.built_pairs(native.kernel_table())
    assert built <= _everything_built() | {("prefill_attention", "avx512")}
    assert {
        ("attention", "portable"),
        ("quant_gemm", "portable"),
        ("kv_codec", "portable"),
        ("lora", "portable"),
    } <= built
    assert kernels.kernel_paths().paths == select_paths(kernels.cpu_flags(), {}, kernels.built_here()).paths


def test_the_paths_are_logged_once_in_one_line(native, caplog):
    kernels._log_paths_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="batchserve.layers.kernels"):
        kernels.chosen_path("attention")
        kernels.chosen_path("small_gemm")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("native kernel paths")]
    assert len(lines) == 1 and "GEMM by rows" in lines[0]


@pytest.mark.parametrize(
    "vendor, family, flags, halves",
    [
        ("AuthenticAMD", "25", SKYLAKE_SP, True),  # Zen 4: AVX-512 in two 256-bit halves
        ("AuthenticAMD", "26", SKYLAKE_SP, False),  # Zen 5: full-width AVX-512
        ("AuthenticAMD", "25", ZEN3, False),  # Zen 3 is family 25 too, without AVX-512
        ("GenuineIntel", "6", SAPPHIRE_RAPIDS, False),
        ("", "", SKYLAKE_SP, False),  # no /proc/cpuinfo fields
    ],
)
def test_avx512_in_halves_by_vendor_family_and_flags(vendor, family, flags, halves):
    assert paths.avx512_in_halves(vendor, family, flags) == halves
