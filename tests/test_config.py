import argparse
import json

import pytest

from batchserve.config import ConfigError, EngineConfig
from batchserve.entrypoints.engine_args import add_engine_arguments, engine_config_from_args


def test_json_file_with_the_seeds_keys(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({
        "max_batch_size": 32, "max_num_tokens": 8192, "scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_memory_fraction": 0.8, "enable_kv_cache_reuse": False, "max_input_len": 1000,
        "block_size": 64,
    }))
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
