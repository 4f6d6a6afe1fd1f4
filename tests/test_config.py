import argparse
import json

import pytest

from batchserve.config import ConfigError, EngineConfig
from batchserve.entrypoints.engine_args import add_engine_arguments, engine_config_from_args


def test_json_file_with_the_seeds_keys(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(
        json.dumps(
            {
                "max_batch_size": 32,
                "max_num_tokens": 8192,
                "scheduler_policy": "guaranteed_no_evict",
                "kv_cache_free_gpu_memory_fraction": 0.8,
                "enable_kv_cache_reuse": False,
                "max_input_len": 1000,
                "block_size": 64,
            }
        )
    )
    config = EngineConfig.from_json_file(path)
    assert config.scheduler.max_batch_size == 32 and config.scheduler.max_num_tokens == 8192
    assert config.scheduler.scheduler_policy == "guaranteed_no_evict" and config.scheduler.max_input_len == 1000
    assert config.cache.kv_cache_memory_fraction == 0.8 and config.cache.enable_prefix_caching is False
    assert config.cache.block_size == 64


def test_unknown_keys_and_bad_values_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown option"):
        EngineConfig.from_options(max_batch_sise=4)
    with pytest.raises(ConfigError, match="scheduler_policy"):
        EngineConfig.from_options(scheduler_policy="greedy")
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig.from_options(block_size=4)
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        EngineConfig.from_json_file(path)


def test_cli_flags_override_the_config_file(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"max_batch_size": 32, "block_size": 32}))
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--max-batch-size", "8", "--no-enable-prefix-caching"])
    config = engine_config_from_args(args)
    assert config.scheduler.max_batch_size == 8 and config.cache.block_size == 32
    assert config.cache.enable_prefix_caching is False
    assert config.to_flat_dict()["max_batch_size"] == 8


# --- the schema at the edge: types, aliases, suggestions, --help ---------------------------------------------------
from batchserve.config import SchedulerPolicy  # noqa: E402
from batchserve.entrypoints.engine_args import ArgumentParser  # noqa: E402
from batchserve.entrypoints.engine_options import SPECS, engine_config, read_config_file  # noqa: E402


@pytest.mark.parametrize(
    "data,words",
    [
        ({"max_batch_size": 8.5}, ["'max_batch_size'", "valid integer", "8.5"]),
        ({"max_batch_size": "eight"}, ["'max_batch_size'", "valid integer", "'eight'"]),
        ({"enable_kv_cache_reuse": "no"}, ["'enable_kv_cache_reuse'", "valid boolean", "'no'"]),
        ({"kv_cache_free_gpu_memory_fraction": "0.5"}, ["'kv_cache_free_gpu_memory_fraction'", "valid number"]),
        ({"scheduler_policy": "greedy"}, ["'scheduler_policy'", "max_utilization, guaranteed_no_evict, static"]),
        ({"dtype": 16}, ["'dtype'", "float32"]),
        ({"max_batch_sise": 4}, ["unknown option 'max_batch_sise'", "did you mean 'max_batch_size'"]),
        ({"max_num_seqs": 4, "max_batch_size": 8}, ["'max_batch_size' given twice", "'max_num_seqs'"]),
        ({"block_size": 4}, ["block_size must be in [8, 128]"]),  # a range: the dataclass's check, still reached
    ],
)
def test_config_files_are_checked_by_type_naming_the_key_and_the_file(tmp_path, data, words):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        engine_config({}, file=path)
    for word in words:
        assert word in str(err.value), str(err.value)
    if "block_size" not in data:
        assert str(path) in str(err.value)


def test_trtllm_and_vllm_names_and_enum_spellings(tmp_path):
    path = tmp_path / "trtllm.json"
    path.write_text(json.dumps({"scheduler_policy": "GUARANTEED_NO_EVICT", "tokens_per_block": 32,
                                "kv_cache_free_gpu_memory_fraction": 1, "enable_kv_cache_reuse": False}))  # fmt: skip
    assert read_config_file(path)["scheduler_policy"] is SchedulerPolicy.GUARANTEED_NO_EVICT
    config = engine_config({"max_num_seqs": 4, "swap_space": 2, "num_gpu_blocks_override": 100}, file=path)
    assert config.scheduler.scheduler_policy is SchedulerPolicy.GUARANTEED_NO_EVICT
    assert config.cache.block_size == 32 and config.cache.kv_cache_memory_fraction == 1.0
    assert config.cache.enable_prefix_caching is False and config.scheduler.max_batch_size == 4
    assert config.cache.swap_space_gb == 2.0 and config.cache.num_kv_blocks == 100


def _parser():
    parser = ArgumentParser(prog="batchserve serve")
    add_engine_arguments(parser)
    return parser


def test_vllm_flag_names_and_enum_spellings_on_the_command_line():
    args = _parser().parse_args(
        ["--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--gpu-memory-utilization", "0.5",
         "--num-gpu-blocks-override", "100", "--swap-space", "2", "--scheduler-policy", "GUARANTEED_NO_EVICT"]
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert (config.scheduler.max_batch_size, config.scheduler.max_num_tokens) == (4, 512)
    assert config.cache.kv_cache_memory_fraction == 0.5 and config.cache.num_kv_blocks == 100
    assert config.cache.swap_space_gb == 2.0 and config.scheduler.scheduler_policy == "guaranteed_no_evict"


def test_a_mistyped_flag_gets_the_closest_one(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-batch-sise", "8", "--gpu-memory-utilisation", "0.5"])
    err = capsys.readouterr().err
    assert "--max-batch-sise: did you mean --max-batch-size?" in err
    assert "--gpu-memory-utilisation: did you mean --gpu-memory-utilization?" in err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-batch-size", "8.5"])  # argparse's own type check
    assert "invalid int value: '8.5'" in capsys.readouterr().err


def test_help_shows_every_option_with_help_choices_and_default():
    text = " ".join(_parser().format_help().split())  # one line: argparse wraps at the terminal's width
    text = text[text.index("engine options (") :]  # the descriptions, not the usage line
    for spec in SPECS:
        flag = "--" + spec.name.replace("_", "-")
        assert flag in text, flag
        entry = text[text.index(flag + " ") if spec.kind is not bool else text.index(flag + ",") :][:400]
        assert spec.help.split(":")[0].split("(")[0].strip()[:20] in entry, (flag, entry)
        assert "default" in entry, (flag, entry)
        for choice in spec.choices or ():
            assert choice in entry, (flag, choice)
    assert "--max-batch-size INT, --max-num-seqs INT" in text


def test_llm_checks_its_options_before_loading_a_model():
    from batchserve.entrypoints.llm import LLM

    with pytest.raises(ConfigError, match=r"LLM\(\.\.\.\): option 'max_batch_size': Input should be a valid integer"):
        LLM(max_batch_size=8.5)
    with pytest.raises(ConfigError, match="did you mean 'enable_prefix_caching'"):
        LLM(enable_prefix_cache=True)


# --- TensorRT-LLM's LLM-API files, every problem at once, short errors, dtype spellings, --model -------------


def test_a_trtllm_serve_extra_llm_api_options_yaml_maps_onto_our_options(tmp_path, caplog):
    path = tmp_path / "extra_llm_api_options.yaml"
    path.write_text(
        "backend: pytorch\n"  # GPU execution only: dropped with a warning
        "max_batch_size: 16\nmax_num_tokens: 1024\nmax_seq_len: 512\nenable_chunked_prefill: false\n"
        "kv_cache_config:\n  free_gpu_memory_fraction: 0.5\n  enable_block_reuse: false\n  tokens_per_block: 32\n"
        "  max_tokens: 1000\n"
        "scheduler_config:\n  capacity_scheduler_policy: STATIC_BATCH\n"
        "  context_chunking_policy: FIRST_COME_FIRST_SERVED\n"
    )
    config = engine_config({}, file=path)
    assert (config.scheduler.max_batch_size, config.scheduler.max_num_tokens) == (16, 1024)
    assert config.scheduler.max_model_len == 512 and config.scheduler.enable_chunked_prefill is False
    assert config.scheduler.scheduler_policy is SchedulerPolicy.STATIC
    assert config.cache.kv_cache_memory_fraction == 0.5 and config.cache.enable_prefix_caching is False
    assert config.cache.block_size == 32 and config.cache.num_kv_blocks == 32  # ceil(1000 / 32)
    assert "'backend' is ignored" in caplog.text


@pytest.mark.parametrize("policy", ["STATIC_BATCH", "MAX_UTILIZATION", "GUARANTEED_NO_EVICT"])
def test_trtllm_enum_names_are_ours_in_files_keywords_and_flags(policy):
    ours = {"STATIC_BATCH": "static"}.get(policy, policy.lower())
    assert engine_config({"scheduler_policy": policy}).scheduler.scheduler_policy == ours
    assert engine_config({"scheduler_config": {"capacity_scheduler_policy": policy}}).scheduler.scheduler_policy == ours
    args = _parser().parse_args(["--scheduler-policy", policy])
    assert engine_config_from_args(args).scheduler.scheduler_policy == ours


def test_every_config_problem_is_listed_at_once_in_a_few_lines(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "max_batch_sise: 4\nblock_size: big\ndtype: fp8\n"
        "kv_cache_config:\n  free_gpu_memory_fraction: 0.5\n  host_cache_sise: 1\n"
    )
    with pytest.raises(ConfigError) as err:
        engine_config({}, file=path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"4 problems in {path}:" and len(lines) == 5, lines
    text = str(err.value)
    for word in ["'max_batch_sise' (did you mean 'max_batch_size'?)", "'block_size': Input should be a valid integer",
                 "'dtype'", "'kv_cache_config.host_cache_sise'"]:  # fmt: skip
        assert word in text, text
    with pytest.raises(ConfigError) as err:  # ranges too: each option checked on its own
        engine_config({"block_size": 4, "max_batch_size": 0, "kv_cache_memory_fraction": 2.0})
    assert str(err.value).startswith("3 problems:"), str(err.value)


def test_a_config_error_on_the_command_line_is_a_few_lines_without_the_usage(tmp_path, capsys):
    from batchserve.entrypoints.openai.launch import main as serve_main

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"max_batch_sise": 4, "block_size": "big"}))
    with pytest.raises(SystemExit) as exc:
        serve_main(["--config", str(path)])  # fails before any model loads
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and len(err.splitlines()) <= 5, err
    assert "2 problems" in err and "max_batch_sise" in err and "block_size" in err


@pytest.mark.parametrize("spelling,ours", [("half", "float16"), ("fp16", "float16"), ("FLOAT16", "float16"),
                                           ("bf16", "bfloat16"), ("fp32", "float32")])  # fmt: skip
def test_dtype_spellings_of_vllm_and_torch(spelling, ours):
    assert engine_config({"dtype": spelling}).dtype == ours
    assert engine_config_from_args(_parser().parse_args(["--dtype", spelling])).dtype == ours


def test_model_is_the_positional_or_vllms_model_flag():
    from batchserve.entrypoints.openai.launch import make_parser

    parser = make_parser()
    assert parser.parse_args(["--model", "org/name"]).model == "org/name"
    assert parser.parse_args(["org/name"]).model == "org/name"
    assert parser.parse_args([]).model is None


def test_prefill_attention_takes_its_four_values_and_names_itself_otherwise():
    for value in ("auto", "native", "sdpa", "SPLIT"):
        assert EngineConfig.from_options(prefill_attention=value).prefill_attention == value.lower()
    with pytest.raises(ConfigError, match="prefill_attention"):
        EngineConfig.from_options(prefill_attention="flash")
