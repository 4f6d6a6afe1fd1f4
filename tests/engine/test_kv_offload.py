"""The disk KV tier on a real (tiny, random) Llama: a prefix evicted from the pool and read back from the tier gives
transformers' greedy tokens, its K/V bit for bit; a restarted engine finds the blocks; a corrupt, truncated or
foreign file and a full disk are each detected, logged, counted and recomputed, the request still served."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from batchserve.config import ConfigError
from batchserve.core.kv_tier import HEADER_BYTES, SUFFIX, TierConfigError
from batchserve.engine.llm_engine import LLMEngine
from batchserve.sampling_params import SamplingParams
from batchserve.worker.kv_cache import _parts
from tests.tiny_models import VOCAB, hf_greedy, tiny_checkpoint

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "llama", "tiny_llama_tier")


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "qwen2", "tiny_qwen_tier")


def engine(directory, tier_dir, dtype="float32", num_kv_blocks=12, **options) -> LLMEngine:
    return LLMEngine.from_options(
        model=str(directory),
        device="cpu",
        dtype=dtype,
        block_size=BLOCK,
        num_kv_blocks=num_kv_blocks,
        kv_offload_dir=str(tier_dir),
        **options,
    )


def prompt(seed: int, length: int = 5 * BLOCK + 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def generate(eng: LLMEngine, tokens: list[int], max_tokens: int = 6, rid: str | None = None) -> list[int]:
    eng.add_prompt(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while eng.has_unfinished_requests():
        for delta in eng.step():
            out += delta.delta_token_ids
    eng.runner.offload.flush()
    return out


def evict_all(eng: LLMEngine, seed: int = 999) -> None:
    """Fill the pool with another prompt's blocks: every cached block of earlier prompts is evicted."""
    generate(eng, prompt(seed, eng.runner.num_kv_blocks * BLOCK - 8), max_tokens=1)


def tier_hit_tokens(eng: LLMEngine, tokens: list[int], max_tokens: int = 6) -> tuple[list[int], int]:
    before = eng.kv_tier.stats.hits
    out = generate(eng, tokens, max_tokens)
    return out, (eng.kv_tier.stats.hits - before) * BLOCK


def test_prefix_read_back_gives_transformers_tokens(tiny, tmp_path):
    model, directory = tiny
    eng = engine(directory, tmp_path)
    tokens = prompt(1)
    first = generate(eng, tokens)
    assert eng.kv_tier.stats.blocks_written >= 5
    evict_all(eng)
    in_place = spy_reads_in_place(eng)
    again, hit = tier_hit_tokens(eng, tokens)
    assert hit == 5 * BLOCK and len(in_place) == 5  # every full prompt block read back, not recomputed
    assert first == again == hf_greedy(model, tokens, 6)
    metrics = scraped(eng)
    assert metrics["batchserve:kv_tier_hit_tokens_total"] == 5 * BLOCK
    assert metrics["batchserve:kv_tier_read_bytes_total"] > 0 and metrics["batchserve:kv_tier_read_seconds_total"] > 0
    eng.close()


def spy_reads_in_place(eng: LLMEngine) -> list:
    """The blocks the engine's tier puts into pool blocks from now on (the real calls, recorded): by read_into, or
    copied from a read begun at lookup, before the request was admitted."""
    offload, store, arrived = eng.kv_tier, eng.kv_tier.store, []
    read_into, copy_in = store.read_into, offload.copy_in
    store.read_into = lambda digest, views: read_into(digest, views) and not arrived.append(digest)
    offload.copy_in = lambda pairs: (copy_in(pairs), arrived.extend(pairs))
    return arrived


def scraped(eng: LLMEngine) -> dict[str, float]:
    """The tier's metrics as a Prometheus scrape reads them."""
    from prometheus_client import CollectorRegistry, generate_latest

    from batchserve.serving.kv_tier_metrics import register_tier_metrics
    from batchserve.serving.metrics import parse_metrics

    registry = CollectorRegistry()
    register_tier_metrics(registry, "m", eng)
    return parse_metrics(generate_latest(registry).decode())


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_blocks_read_back_bit_equal(tiny, tmp_path, threads):
    """An engine computing on one core or two reads with one reader thread (tests/core covers two readers sharing a
    load); a float pool takes each block in one strided copy (views_of None) and the K/V come back bit for bit."""
    _, directory = tiny
    eng = engine(directory, tmp_path, dtype="bfloat16", num_threads=threads)
    assert eng.kv_tier.readers == 1 and eng.kv_tier.views_of is None
    tokens = prompt(2, 4 * BLOCK + 1)
    generate(eng, tokens, max_tokens=1)
    kv = eng.scheduler.kv
    written = _blocks_of(eng, tokens)
    evict_all(eng)
    assert all(kv.pool.lookup(key) is None for key, _ in written)
    in_place = spy_reads_in_place(eng)
    _, hit = tier_hit_tokens(eng, tokens, max_tokens=1)
    assert hit == 4 * BLOCK and len(in_place) == 4  # read into the pool's rows (or copied from a read begun earlier)
    for key, before in written:
        block = kv.pool.lookup(key)
        assert block is not None
        after = [t[block.block_id].clone() for layer in eng.runner.kv_caches for t in _parts(layer)]
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before, after))
    eng.close()


def _blocks_of(eng: LLMEngine, tokens: list[int]):
    """(key, K/V of every layer) of the prompt's cached full blocks."""
    from batchserve.core.block_pool import BlockKey

    out, parent = [], None
    for i in range(len(tokens) // BLOCK):
        key = BlockKey(parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
        block = eng.scheduler.kv.pool.lookup(key)
        out.append((key, [t[block.block_id].clone() for layer in eng.runner.kv_caches for t in _parts(layer)]))
        parent = key.hash
    return out


def test_restart_finds_the_blocks(tiny, tmp_path):
    model, directory = tiny
    tokens = prompt(3)
    first = engine(directory, tmp_path)
    expected = generate(first, tokens)
    first.close()
    second = engine(directory, tmp_path)
    assert len(second.kv_tier.store) >= 5
    out, hit = tier_hit_tokens(second, tokens)
    assert hit == 5 * BLOCK and out == expected == hf_greedy(model, tokens, 6)
    second.close()


def _files(eng: LLMEngine) -> list[Path]:
    return sorted(eng.kv_tier.store.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "other_model"])
def test_bad_file_is_dropped_and_recomputed(tiny, other, tmp_path, caplog, damage):
    model, directory = tiny
    tokens = prompt(4)
    eng = engine(directory, tmp_path)
    expected = generate(eng, tokens)
    evict_all(eng)
    digests = eng.scheduler.kv.tier.req_digests  # forgotten once done: recompute the third block's file name
    assert not digests
    third = _digest_chain(eng, tokens)[2]
    path = eng.kv_tier.store.path_of(third)
    data = bytearray(path.read_bytes())
    if damage == "flipped_byte":
        data[HEADER_BYTES + 100] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # another model's engine wrote a file under this name (a copy from a foreign fingerprint's directory)
        foreign = engine(other[1], tmp_path)  # the same directory: its own fingerprint's folder
        generate(foreign, prompt(7), max_tokens=1)
        shutil.copy(_files(foreign)[0], path)
        foreign.close()
    caplog.set_level(logging.WARNING, logger="batchserve.core.kv_tier")
    out, hit = tier_hit_tokens(eng, tokens)
    assert out == expected == hf_greedy(model, tokens, 6)
    assert hit == 2 * BLOCK  # the blocks before the bad one came from the tier; it and the rest were recomputed
    assert eng.kv_tier.stats.corrupt_dropped == 1
    assert any("dropped" in r.message and third.hex() in r.message for r in caplog.records)
    assert scraped(eng)["batchserve:kv_tier_corrupt_dropped_total"] == 1
    eng.close()


def _digest_chain(eng: LLMEngine, tokens: list[int]) -> list[bytes]:
    from batchserve.core.block_pool import BlockKey
    from batchserve.core.kv_tier import block_digest

    chain, parent = [], None
    for i in range(len(tokens) // BLOCK):
        key = BlockKey(parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
        chain.append(block_digest(chain[-1] if chain else None, key))
        parent = key.hash
    return chain


def test_full_disk_keeps_serving(tiny, tmp_path, caplog, monkeypatch):
    model, directory = tiny
    eng = engine(directory, tmp_path)
    real_replace = os.replace

    def no_space(src, dst):
        if str(dst).endswith(SUFFIX):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", no_space)
    caplog.set_level(logging.WARNING, logger="batchserve.core.kv_tier")
    tokens = prompt(5)
    first = generate(eng, tokens)
    assert eng.kv_tier.stats.write_errors >= 5 and eng.kv_tier.stats.blocks_written == 0
    assert any("disk full" in r.message for r in caplog.records)
    assert scraped(eng)["batchserve:kv_tier_write_errors_total"] == eng.kv_tier.stats.write_errors
    assert not list(eng.kv_tier.store.dir.glob("*.tmp"))  # no temporary file left behind
    evict_all(eng)
    out, hit = tier_hit_tokens(eng, tokens)
    assert hit == 0 and out == first == hf_greedy(model, tokens, 6)
    eng.close()


def test_two_engines_write_the_same_blocks(tiny, tmp_path):
    model, directory = tiny
    tokens = prompt(6)
    a, b = engine(directory, tmp_path), engine(directory, tmp_path)
    out_a, out_b = generate(a, tokens), generate(b, tokens)
    assert len(_files(a)) == len(tokens) // BLOCK + 0  # one file per block, whoever wrote it
    evict_all(a)
    out, hit = tier_hit_tokens(a, tokens)
    assert hit == 5 * BLOCK and out == out_a == out_b == hf_greedy(model, tokens, 6)
    assert a.kv_tier.stats.corrupt_dropped == 0
    a.close()
    b.close()


def test_bad_options_are_refused_naming_them(tiny, tmp_path):
    _, directory = tiny
    with pytest.raises(ConfigError, match="kv_offload_dir .*missing.* is not an existing directory"):
        engine(directory, tmp_path / "missing")
    with pytest.raises(TierConfigError, match="kv_offload_dir '/proc' is not writable"):
        engine(directory, "/proc")
    with pytest.raises(TierConfigError, match="kv_offload_max_bytes 1000 is smaller than one KV block"):
        engine(directory, tmp_path, kv_offload_max_bytes=1000)


def test_a_windowed_model_runs_without_the_tier_and_says_so(tmp_path_factory, tmp_path, caplog):
    model, directory = tiny_checkpoint(tmp_path_factory, "mistral_window", "tiny_mistral_window_tier")
    caplog.set_level(logging.WARNING, logger="batchserve.modes")
    eng = engine(directory, tmp_path)
    assert eng.kv_tier is None and eng.config.cache.kv_offload_dir is None
    assert any("mode fallback kv_offload_with_windows" in r.message for r in caplog.records)
    tokens = prompt(8, 40)
    eng.add_prompt(None, tokens, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    out = []
    while eng.has_unfinished_requests():
        out += [t for d in eng.step() for t in d.delta_token_ids]
    assert out == hf_greedy(model, tokens, 4)
    eng.close()
