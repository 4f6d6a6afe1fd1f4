"""quantization auto, the default: the kernel table's one rule (layers/kernels/paths.py gguf_as_stored_rule) on each
host class's CPU flags, and an engine on a tiny Q4_1 GGUF that runs it as stored (the same tokens as quantization
gguf) where the rule says so, dequantized (the same tokens as quantization none) where not and always in float32,
saying which in one start-up line; explicit values run as asked, without the line."""

from __future__ import annotations

import json
import logging

import pytest

from batchserve import LLM, SamplingParams, env
from batchserve.config import ConfigError, EngineConfig
from batchserve.layers import quantization
from batchserve.layers.kernels.paths import OPERATIONS, gguf_as_stored_rule
from tests.forcing import HOST_CLASS_FLAGS
from tests.layers.test_gguf_as_stored import tiny_llama, write_quantized_gguf

EVERY_KERNEL = frozenset((op, p.isa) for op, o in OPERATIONS.items() for p in o.paths if p.isa is not None)
PROMPTS = [[5, 9, 2, 7], [3, 3, 8]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LINE = "quantization auto: "
FORCED_WIN = "weight-only, a win forced by the test"


@pytest.fixture
def force_as_stored_win(monkeypatch):
    """force_as_stored_win(): the rule's table records the weight-only avx512 path faster on the AMX class."""
    from batchserve.layers.kernels import paths

    def force() -> None:
        monkeypatch.setitem(paths.AS_STORED_MEASURED, ("avx512", "amx_bf16"), (True, FORCED_WIN))

    return force


@pytest.mark.parametrize(
    "host_class, dtype, as_stored",
    [
        ("amx", "bfloat16", False),  # measured here: weight-only avx512 is slower than the AMX bf16 GEMMs on peer64
        ("avx512_bf16", "bfloat16", False),  # W8A8 measured faster there (AMD family 25), weight-only not measured
        ("avx512", "bfloat16", False),  # no bf16 matmul units: bf16 is not auto's dtype there, not measured
        ("avx2", "bfloat16", False),
        ("amx", "float32", False),  # the exactness reference, on every class
        ("avx2", "float32", False),
        ("amx", "float16", False),  # not measured
    ],
)
def test_the_rule_per_host_class(host_class, dtype, as_stored):
    choice = gguf_as_stored_rule(dtype, HOST_CLASS_FLAGS[host_class], {}, EVERY_KERNEL)
    assert choice.as_stored is as_stored, choice.reason
    assert choice.quant_gemm_path is None
    if host_class == "amx" and dtype == "bfloat16":  # the weight-only path, not W8A8, though this class runs it
        assert choice.reason.startswith("quantized GEMM path avx512: weight-only, measured slower than the dequantized")
    if host_class == "avx512_bf16" and dtype == "bfloat16":
        assert choice.reason == "quantized GEMM path avx512: not measured against the dequantized model here"
    if dtype == "float32":
        assert choice.reason == "dtype float32: the exactness reference"


def test_the_rule_reads_a_forced_path_and_the_build():
    amx = HOST_CLASS_FLAGS["amx"]
    w8a8 = gguf_as_stored_rule("bfloat16", amx, {"BATCHSERVE_QUANT_GEMM_PATH": "avx512_vnni"}, EVERY_KERNEL)
    assert not w8a8.as_stored and "avx512_vnni (W8A8): int8 activations" in w8a8.reason
    forced = gguf_as_stored_rule("bfloat16", amx, {"BATCHSERVE_QUANT_GEMM_PATH": "avx2"}, EVERY_KERNEL)
    assert not forced.as_stored and "path avx2: not measured against" in forced.reason
    no_avx512 = EVERY_KERNEL - {("quant_gemm", "avx512")}  # the next weight-only path: avx2, not measured on AMX
    assert "path avx2: not measured" in gguf_as_stored_rule("bfloat16", amx, {}, no_avx512).reason
    assert "path avx512: weight-only" in gguf_as_stored_rule("bfloat16", amx, {}, EVERY_KERNEL).reason
    assert gguf_as_stored_rule("bfloat16", amx, {}, None).reason == "no native weight-only quantized GEMM here"
    with pytest.raises(ValueError, match="BATCHSERVE_QUANT_GEMM_PATH='avx512'"):  # a forced path that cannot run
        gguf_as_stored_rule("bfloat16", amx, {"BATCHSERVE_QUANT_GEMM_PATH": "avx512"}, no_avx512)


def test_a_measured_win_runs_as_stored_on_its_weight_only_path(force_as_stored_win):
    """Where the table records as stored faster (forced here: no class's weight-only path is, today), the choice
    carries that weight-only path for the projections' policy."""
    force_as_stored_win()
    amx = HOST_CLASS_FLAGS["amx"]
    choice = gguf_as_stored_rule("bfloat16", amx, {}, EVERY_KERNEL)
    assert choice.as_stored and choice.quant_gemm_path == "avx512"
    assert choice.reason == f"quantized GEMM path avx512: {FORCED_WIN}"
    no_vnni = EVERY_KERNEL - {("quant_gemm", "avx512_vnni")}  # W8A8 is not what auto reads
    assert gguf_as_stored_rule("bfloat16", amx, {}, no_vnni).quant_gemm_path == "avx512"
    assert not gguf_as_stored_rule("bfloat16", HOST_CLASS_FLAGS["avx512_bf16"], {}, EVERY_KERNEL).as_stored


@pytest.fixture
def tiny_q4_1(tmp_path, monkeypatch):
    monkeypatch.setattr(env, "cache_dir", lambda: tmp_path / "cache")
    path = tmp_path / "tiny-Q4_1.gguf"
    write_quantized_gguf(tiny_llama(tmp_path / "hf", 64), path, "Q4_1", monkeypatch)
    return path


def _run(path, dtype: str, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(path), dtype=dtype, device="cpu", num_kv_blocks=16, max_batch_size=4, **options)
    return llm, [list(out.token_ids) for out in llm.generate(PROMPTS, PARAMS)]


def _auto_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(LINE)]


def _gemm_paths(llm: LLM) -> set[str]:
    return {m.gemm_path for m in llm.engine.runner.model.modules() if isinstance(m, quantization.QuantizedLinear)}


def test_auto_is_the_default_and_runs_as_stored_where_the_rule_wins(
    tiny_q4_1, force_auto_flags, force_as_stored_win, force_quant_gemm, caplog
):
    assert EngineConfig().quantization == "auto"
    if not quantization.quant_gemm_path_runs("avx512"):
        pytest.skip("the avx512 quantized GEMM (auto's weight-only path on the AMX class) does not run here")
    force_auto_flags("amx")
    force_as_stored_win()
    with caplog.at_level(logging.INFO):
        auto, tokens = _run(tiny_q4_1, "bfloat16")
    assert auto.engine.config.quantization == "gguf"  # the effective value
    assert _gemm_paths(auto) == {"avx512"}  # the policy's weight-only path, whatever the kernel table prefers
    assert _auto_lines(caplog) == [
        f"quantization auto: gguf as stored (quantized GEMM path avx512: {FORCED_WIN}; "
        "docs/quantization.md#quantization-auto)"
    ]
    assert "quantization_auto" in [rule.name for rule in auto.engine.runner.modes.covered]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        stored, _ = _run(tiny_q4_1, "bfloat16", quantization="gguf")
    assert not _auto_lines(caplog)  # explicit: as asked, no line, on the kernel table's path (W8A8 where it runs)
    assert _gemm_paths(stored) == {quantization.quant_gemm_path()}
    force_quant_gemm("avx512")  # explicit gguf on the weight-only path: auto's tokens
    assert _run(tiny_q4_1, "bfloat16", quantization="gguf")[1] == tokens
    assert all(len(ids) == PARAMS.max_tokens for ids in tokens)


def test_auto_dequantizes_where_the_rule_does_not_win_and_in_float32(tiny_q4_1, force_auto_flags, caplog):
    force_auto_flags("avx2")
    with caplog.at_level(logging.INFO):
        auto, tokens = _run(tiny_q4_1, "bfloat16")
    assert auto.engine.config.quantization == "none"
    assert not any(isinstance(m, quantization.QuantizedLinear) for m in auto.engine.runner.model.modules())
    assert _auto_lines(caplog) == [
        "quantization auto: dequantized to bf16 (no bf16 matmul units on this CPU: as stored not measured against "
        "bf16 here; docs/quantization.md#quantization-auto)"
    ]
    assert tokens == _run(tiny_q4_1, "bfloat16", quantization="none")[1]
    force_auto_flags("amx")  # where bf16 would run as stored, float32 stays the dequantized reference
    caplog.clear()
    with caplog.at_level(logging.INFO):
        auto32, tokens32 = _run(tiny_q4_1, "float32")
    assert auto32.engine.config.quantization == "none"
    assert _auto_lines(caplog) == [
        "quantization auto: dequantized to float32 (dtype float32: the exactness reference; "
        "docs/quantization.md#quantization-auto)"
    ]
    assert tokens32 == _run(tiny_q4_1, "float32", quantization="none")[1]


def test_a_converted_file_starts_again_without_parsing_its_header(tiny_q4_1):
    """The converted folder keeps the file's tensor types, so auto decides a later start from them: parsing a real
    header again (its token list) was seconds of every start-up, in every server, engine core and replica."""
    import gguf

    from batchserve.models import gguf_config
    from batchserve.models.loader import TENSOR_TYPES_FILE, gguf_cache_dir, gguf_tensor_types

    want = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tiny_q4_1).tensors}
    assert "Q4_1" in want.values()
    _, tokens = _run(tiny_q4_1, "float32")  # converts the file
    record = gguf_cache_dir(tiny_q4_1) / TENSOR_TYPES_FILE
    assert json.loads(record.read_text()) == want and list(json.loads(record.read_text())) == list(want)
    gguf_config._gguf_reader.cache_clear()
    again, tokens_again = _run(tiny_q4_1, "float32")
    assert gguf_config._gguf_reader.cache_info().misses == 0  # no header parsed
    assert again.engine.config.quantization == "none" and tokens_again == tokens
    record.unlink()  # a folder converted before the types were kept: they are added the first time they are asked
    assert gguf_tensor_types(tiny_q4_1) == want and json.loads(record.read_text()) == want


def test_a_hugging_face_folder_and_explicit_values(tmp_path, caplog):
    from batchserve.engine.auto_quantization import resolve_quantization
    from batchserve.models.loader import load_model_config
    from tests.tiny_models import build_hf_model

    folder = tmp_path / "hf"
    build_hf_model("llama", folder)
    config = EngineConfig()
    with caplog.at_level(logging.INFO):
        resolve_quantization(config, folder, load_model_config(folder), "cpu", "bfloat16")
    assert config.quantization == "none"
    assert _auto_lines(caplog) == [
        "quantization auto: dequantized to bf16 (not a GGUF file: no stored codes; "
        "docs/quantization.md#quantization-auto)"
    ]
    for asked in ("none", "gguf", "int8"):  # an explicit value is left as asked
        explicit = EngineConfig(quantization=asked)
        assert resolve_quantization(explicit, folder, load_model_config(folder), "cpu", "bfloat16") is None
        assert explicit.quantization == asked
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig.from_options(quantization="automatic")
    with pytest.raises(ConfigError, match="quantization auto: resolve it"):
        quantization.parse_quantization("auto")


def test_what_keeps_a_gguf_dequantized_whatever_the_cpu(
    tmp_path, monkeypatch, tiny_q4_1, force_auto_flags, force_as_stored_win
):
    """A type the as-stored kernels do not take, a GPU, split ranks: dequantized, naming why (the class would win)."""
    from batchserve.engine.auto_quantization import choose
    from batchserve.models.loader import load_model_config

    force_auto_flags("amx")
    force_as_stored_win()
    q5_0 = tmp_path / "tiny-Q5_0.gguf"
    write_quantized_gguf(tiny_llama(tmp_path / "hf5", 64), q5_0, "Q5_0", monkeypatch)
    cases = [
        (q5_0, EngineConfig(), "cpu", "tensor blk.0.attn_q.weight (Q5_0): a type the as-stored kernels do not take"),
        (tiny_q4_1, EngineConfig(), "cuda", "device cuda: the quantized kernels run on the CPU only"),
        (tiny_q4_1, EngineConfig(tensor_parallel_size=2), "cpu", "the model is split over ranks, which hold float "
         "shards"),
        (tiny_q4_1, EngineConfig(enable_lora=True), "cpu", "enable_lora: adapters run over the dequantized "
         "projections"),
    ]  # fmt: skip
    for path, config, device, reason in cases:
        assert choose(config, path, load_model_config(path), device, "bfloat16").reason == reason
    assert choose(EngineConfig(), tiny_q4_1, load_model_config(tiny_q4_1), "cpu", "bfloat16").quantization == "gguf"


@pytest.mark.slow
@pytest.mark.parametrize("as_stored", [False, True], ids=["this host's choice", "weight-only as stored"])
def test_the_readme_chat_example_answers_paris_under_the_default(force_auto_flags, force_as_stored_win, as_stored):
    """The README's 30-second example on the default model under the default quantization auto, in bf16: as stored
    on W8A8 (int8 activations) it answered "L'Étoile, la Marseillaise, ..."; dequantized it answers "The capital of
    France is Paris.", and so it must as stored on the weight-only path where the table records a win (forced: the
    AMX class with a win, where the avx512 path runs)."""
    from batchserve.models.loader import resolve_model_path

    try:
        resolve_model_path(None)
    except Exception as exc:  # noqa: BLE001  (whatever stops the default model from loading: not installed here)
        pytest.skip(f"default model not installed: {exc}")
    if as_stored:
        if not quantization.quant_gemm_path_runs("avx512"):
            pytest.skip("the avx512 quantized GEMM does not run here")
        force_auto_flags("amx")
        force_as_stored_win()
    llm = LLM(dtype="bfloat16", device="cpu", max_batch_size=32)
    if as_stored:
        assert llm.engine.config.quantization == "gguf" and _gemm_paths(llm) == {"avx512"}
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # fmt: skip
    assert "Paris" in outs[0].text, outs[0].text
