"""A step's shape read from the real scheduler's decisions: decodes behind a shared prefix read its blocks once."""

from __future__ import annotations

from batchserve.config import EngineConfig
from batchserve.sampling_params import SamplingParams
from batchserve.simulator.engine import SimEngine
from tests.simulator.helpers import STEP_MODEL

PREFIX = list(range(100, 116))  # two full blocks of 8


def decode_step_shape(enable_prefix_caching: bool):
    config = EngineConfig.from_options(block_size=8, enable_prefix_caching=enable_prefix_caching)
    engine = SimEngine(config, STEP_MODEL, 64, 1024)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("first", PREFIX, params)
    engine.step()  # the prefix is computed and its full blocks cached
    engine.add_request("a", [*PREFIX, 7, 8], params)
    engine.add_request("b", [*PREFIX, 9], params)
    engine.step()  # their few new tokens beside first's decode
    engine.step()
    return engine.runner.last_shape


def test_decodes_behind_a_shared_prefix_read_its_blocks_once():
    shape = decode_step_shape(enable_prefix_caching=True)
    assert shape.kind == "decode" and shape.seqs == 3
    # first has 16 + 2 tokens, a 18 + 1, b 17 + 1: each reads its whole context
    assert shape.decode_ctx == 18 + 19 + 18
    # the prefix's 2 blocks of 8 are read by all three rows: from memory once, the two other reads of 16 are repeats
    assert shape.decode_ctx_distinct == shape.decode_ctx - 2 * 16


def test_without_prefix_caching_every_position_is_distinct():
    shape = decode_step_shape(enable_prefix_caching=False)
    assert shape.decode_ctx == 18 + 19 + 18 and shape.decode_ctx_distinct == shape.decode_ctx
