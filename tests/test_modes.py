"""The mode table (batchserve/modes.py) without a model: each row fires on its condition only, a refusal names the
options and what works, a fallback is one log line and sets what the engine runs, the engine enforces the table at
start (the FakeRunner's engine here; the real start-up in tests/test_mode_cells.py), the simulator follows it, the
metrics export it and the docs render it."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from batchserve import modes
from batchserve.config import ConfigError, EngineConfig, ModelConfig
from batchserve.modes import RULES, ModeFacts, ModeRefused, Verdict, decide
from tests.doubles import tiny_model_config

# One set of facts per row that makes it fire (and, with the plain facts, none other of its verdict).
FIRING = {
    "quantized_weights_off_cpu": ModeFacts(device="cuda", quantization="int8"),
    "gguf_codes_need_a_gguf_file": ModeFacts(quantization="gguf", gguf_file=False),
    "eight_bit_kv_with_windows_or_softcaps": ModeFacts(kv_cache_dtype="int8", windowed=True),
    "deterministic_with_speculation": ModeFacts(deterministic=True, speculative_method="ngram"),
    "static_policy_drops_speculation": ModeFacts(scheduler_policy="static", speculative_method="suffix"),
    "static_policy_keeps_no_slots": ModeFacts(scheduler_policy="static", slo_reserved_slots=8),
    "kv_pool_dtype_not_the_models": ModeFacts(dtype="bfloat16", kv_cache_dtype="float32"),
    "float16_on_cpu_runs_the_torch_code": ModeFacts(dtype="float16"),
    "eight_bit_kv_on_gpu": ModeFacts(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3"),
    "moe_without_cuda_graphs": ModeFacts(device="cuda", moe=True),
    "deterministic_off_the_cpu": ModeFacts(device="cuda", deterministic=True),
    "deterministic_without_native_kernels": ModeFacts(deterministic=True, native_kernels=False),
    "deterministic_with_windows_or_softcaps": ModeFacts(deterministic=True, softcapped=True),
    "quantization_auto": ModeFacts(quantization="gguf", quantization_auto=True),
    "deterministic_with_quantized_weights": ModeFacts(deterministic=True, quantization="int4"),
    "deterministic_with_eight_bit_kv": ModeFacts(deterministic=True, kv_cache_dtype="int8"),
    "kv_offload_needs_prefix_caching": ModeFacts(kv_offload=True, prefix_caching=False),
    "kv_offload_with_windows": ModeFacts(kv_offload=True, windowed=True),
    "kv_offload_off_the_cpu": ModeFacts(kv_offload=True, device="cuda"),
    "lora_with_moe": ModeFacts(lora=True, moe=True, native_kernels=False),
    "lora_with_static_batching": ModeFacts(lora=True, scheduler_policy="static", native_kernels=False),
    "lora_steps_without_cuda_graphs": ModeFacts(lora=True, device="cuda"),
    "pipeline_parallel_with_speculation": ModeFacts(pipeline_parallel_size=2, speculative_method="ngram"),
    "parallel_ranks_off_cpu": ModeFacts(device="cuda", tensor_parallel_size=2),
    "lora_with_parallel_ranks": ModeFacts(lora=True, tensor_parallel_size=2),
    "kv_offload_with_parallel_ranks": ModeFacts(kv_offload=True, pipeline_parallel_size=2),
    "parallel_ranks_with_quantized_weights": ModeFacts(pipeline_parallel_size=2, quantization="int4"),
    "tensor_parallel_with_a_draft_model": ModeFacts(tensor_parallel_size=2, speculative_method="draft_model"),
    "parallel_ranks_run_python_layers": ModeFacts(tensor_parallel_size=2, pipeline_parallel_size=2),
    "ray_ranks_all_reduce_by_gloo": ModeFacts(executor_backend="ray", tensor_parallel_size=2),
}


def test_every_rule_has_a_firing_case_and_unique_name():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    assert set(FIRING) == set(names)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_rule_fires_on_its_condition(rule):
    fired = decide(FIRING[rule.name])
    assert rule in fired.refused + fired.fallbacks + fired.covered


def test_plain_facts_fire_nothing():
    """The default engine (CPU, float32 or bf16, auto pool, no special mode) runs as asked, silently."""
    for dtype in ("float32", "bfloat16"):
        decision = decide(ModeFacts(dtype=dtype))
        assert decision.refused == decision.fallbacks == decision.covered == ()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_row_is_complete(rule):
    assert rule.condition and rule.reason and rule.remedy and rule.options
    assert rule.verdict in Verdict
    page = rule.anchor.split("#")[0]
    assert re.fullmatch(r"[a-z0-9-]+\.md", page), rule.anchor
    if rule.adjust is not None:
        assert rule.verdict == Verdict.FALL_BACK  # only a fallback changes what runs


def test_a_refusal_names_the_options_and_what_works():
    with pytest.raises(ModeRefused) as refused:
        modes.enforce(EngineConfig(), ModeFacts(deterministic=True, speculative_method="ngram"))
    message = str(refused.value)
    assert isinstance(refused.value, ConfigError)
    assert "deterministic, speculative_config" in message and "drop speculative_config" in message
    assert "docs/determinism.md#what-it-guarantees" in message


def test_every_refusal_is_reported_at_once():
    facts = ModeFacts(device="cuda", quantization="int8", deterministic=True, speculative_method="ngram")
    with pytest.raises(ModeRefused) as refused:
        modes.enforce(EngineConfig(), facts)
    assert [r.name for r in refused.value.rules] == ["quantized_weights_off_cpu", "deterministic_with_speculation"]


def test_a_fallback_is_one_log_line_and_sets_the_option_the_engine_runs(caplog):
    config = EngineConfig(speculative_config={"method": "ngram"})
    config.scheduler.scheduler_policy = "static"
    with caplog.at_level(logging.WARNING, logger="batchserve.modes"):
        decision = modes.enforce(config, ModeFacts(scheduler_policy="static", speculative_method="ngram"))
    assert decision.fallback_names == ["static_policy_drops_speculation"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("mode fallback static_policy_drops_speculation:")
    assert config.speculative_config is None


def test_a_covered_combination_logs_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="batchserve.modes"):
        decision = modes.enforce(EngineConfig(), ModeFacts(deterministic=True, quantization="int8"))
    assert [r.name for r in decision.covered] == ["deterministic_with_quantized_weights"]
    assert caplog.records == []


def test_model_traits_come_from_the_config():
    plain = tiny_model_config(32)
    assert modes.model_traits(plain) == {"windowed": False, "softcapped": False, "moe": False}
    mistral = dataclasses.replace(plain, sliding_window=8)
    qwen = dataclasses.replace(plain, extra={"windowed_layers": [1], "layer_window": 8})
    gemma2 = dataclasses.replace(plain, extra={"sliding_window": 8, "attn_softcap": 5.0, "final_softcap": 8.0})
    moe = dataclasses.replace(plain, num_experts=4, num_experts_per_tok=2)
    assert modes.model_traits(mistral)["windowed"] and modes.model_traits(qwen)["windowed"]
    assert modes.model_traits(gemma2) == {"windowed": True, "softcapped": True, "moe": False}
    assert modes.model_traits(moe)["moe"]


def _facts(config: EngineConfig, model: ModelConfig | None = None, **host) -> ModeFacts:
    return ModeFacts.of(config, model, host.get("device", "cpu"), host.get("dtype", "float32"), True)


def test_facts_read_the_options():
    config = EngineConfig.from_options(
        deterministic=True, quantization="int4", kv_cache_dtype="int8", scheduler_policy="STATIC",
        speculative_config='{"method": "suffix"}',
    )  # fmt: skip
    facts = _facts(config, tiny_model_config(32))
    assert (facts.deterministic, facts.quantization, facts.kv_cache_dtype) == (True, "int4", "int8")
    assert (facts.scheduler_policy, facts.speculative_method) == ("static", "suffix")
    assert _facts(EngineConfig.from_options(distributed_executor_backend="ray")).executor_backend == "ray"


# ---- the engine, the simulator, the metrics and the docs follow the table ------------------------------------------


def test_the_engine_refuses_at_start(make_engine):
    with pytest.raises(ModeRefused, match="deterministic with speculative_config"):
        make_engine(deterministic=True, speculative_config={"method": "ngram"})


def test_the_engine_under_the_static_policy_does_not_speculate_and_says_so(make_engine, caplog):
    with caplog.at_level(logging.WARNING, logger="batchserve.modes"):
        engine = make_engine(scheduler_policy="static", speculative_config={"method": "ngram"})
    assert engine.scheduler.speculation is None
    assert engine.modes.fallback_names == ["static_policy_drops_speculation"]
    assert engine.effective_config()["speculative_config"] is None
    assert sum("static_policy_drops_speculation" in r.getMessage() for r in caplog.records) == 1
    speculating = make_engine(speculative_config={"method": "ngram"})
    assert speculating.scheduler.speculation is not None and speculating.modes.fallbacks == ()


def test_the_engine_under_the_static_policy_keeps_no_slot_and_says_so(make_engine):
    engine = make_engine(scheduler_policy="static", slo_admission="refuse", max_batch_size=8)
    assert engine.modes.fallback_names == ["static_policy_keeps_no_slots"]
    assert engine.scheduler.reserve.reserved == 0
    assert engine.effective_config()["slo_reserved_slots"] == "0"
    assert make_engine(slo_admission="refuse", max_batch_size=8).scheduler.reserve.reserved == 2


def test_the_simulator_follows_the_table():
    config = EngineConfig(speculative_config={"method": "ngram"})
    assert modes.effective_speculation(config) is not None
    config.scheduler.scheduler_policy = "static"
    assert modes.effective_speculation(config) is None
    assert config.speculative_config is not None  # the caller's config is left as given


def test_the_metrics_label_each_fallback(make_engine):
    from batchserve.engine.async_engine import AsyncLLMEngine
    from batchserve.serving.metrics import EngineMetrics, parse_metrics

    engine = make_engine(scheduler_policy="static", speculative_config={"method": "ngram"})
    metrics = EngineMetrics("tiny").attach(AsyncLLMEngine(engine))
    text = metrics.render().decode()
    assert 'batchserve:mode_fallback{model_name="tiny",rule="static_policy_drops_speculation"} 1.0' in text
    assert parse_metrics(text)  # still parses


def test_the_configuration_page_renders_every_rule():
    import importlib.util
    from pathlib import Path

    hook = Path(__file__).resolve().parent.parent / "docs" / "hooks" / "reference.py"
    spec = importlib.util.spec_from_file_location("reference_hook", hook)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    page = reference.on_page_markdown("before\n<!-- generated: mode-rules -->\nafter")
    assert "generated: mode-rules" not in page
    for rule in RULES:
        assert f"| `{rule.name}` |" in page and f"**{rule.verdict.value}**" in page
