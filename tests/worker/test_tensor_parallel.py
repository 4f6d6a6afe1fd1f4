"""Tensor and pipeline parallelism end to end (worker/parallel_executor.py, worker/rank_worker.py,
models/sharding.py, models/pipeline.py): one process a rank, one thread each. Greedy float32 tokens at TP=2, PP=2 and
TP=2 x PP=2 equal one rank's and transformers' on tiny random models of three families (one KV head on two ranks:
replicated; Qwen3's q/k norms; a Qwen3-MoE whose experts are split by column), with chunked prefills beside decodes
and a pool that grows (TP=2 x PP=2 with the decode rows in micro-batches), through the offline API and HTTP; a rank
killed mid-run ends the engine with an error naming it within seconds."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import threading
import time

import httpx
import pytest
import torch
import transformers

from batchserve.config import ConfigError, EngineConfig
from batchserve.engine.llm_engine import LLMEngine
from batchserve.entrypoints.llm import LLM
from batchserve.sampling_params import SamplingParams
from batchserve.worker.parallel_executor import RankDiedError
from tests.models.test_moe import MOE_KINDS
from tests.server.live import start_server
from tests.tiny_models import build_hf_model, hf_greedy, save_word_tokenizer, text_after

PROMPTS = [[5, 9, 17, 33, 40, 41, 7, 12, 60, 3, 44], [8, 70], [23, 24, 25, 26, 27, 28]]
MAX_TOKENS = 10
# one thread a rank (the hosts these run on have two cores); an 8-token budget chunks the longest prompt beside the
# others' decodes; blocks of 8 so that sequences span several
OPTIONS = dict(dtype="float32", num_threads=1, max_num_tokens=8, block_size=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _moe_model(kind: str, directory):
    """A tiny Qwen3-MoE as tests/models/test_moe.py builds it (spread routing, norms around 1)."""
    torch.manual_seed(sum(map(ord, kind)))
    hf = transformers.AutoModelForCausalLM.from_config(MOE_KINDS[kind](), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                param.normal_(0.0, 0.1)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            directory = tmp_path_factory.mktemp(kind)
            hf = _moe_model(kind, directory) if kind in MOE_KINDS else build_hf_model(kind, directory)
            save_word_tokenizer(directory)
            cache[kind] = (hf, directory)
        return cache[kind]

    return get


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [out.token_ids for out in outputs]


@pytest.fixture(scope="module")
def single_rank(models):
    """kind -> one rank's greedy tokens, checked against transformers' once."""
    cache = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            hf, directory = models(kind)
            cache[kind] = _generate(LLM(str(directory), **OPTIONS))
            assert cache[kind] == [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in PROMPTS]
        return cache[kind]

    return get


# llama_head64: 2 query heads, 1 KV head (replicated on both ranks); qwen3: q/k norms, head_dim 24, 2 KV heads split;
# qwen3_moe: experts split by column, a dense layer between sparse ones (3 layers: stages of 2 and 1)
@pytest.mark.parametrize(
    ("kind", "tp", "pp"),
    [("llama_head64", 2, 1), ("qwen3", 2, 1), ("qwen3_moe", 2, 1), ("llama_head64", 1, 2), ("qwen3_moe", 1, 2),
     ("qwen3", 2, 2)],
)  # fmt: skip
def test_split_ranks_give_one_rank_and_transformers_tokens(models, single_rank, kind, tp, pp):
    _, directory = models(kind)
    want = single_rank(kind)
    micro = 2 if tp * pp == 4 else 1  # the stages' hand-over in micro-batches, all-reduces inside each
    llm = LLM(str(directory), tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_micro_batches=micro,
              **OPTIONS)  # fmt: skip
    runner = llm.engine.runner
    assert runner.tp.size == tp and len(runner.workers) == tp * pp - 1
    hf_config = models(kind)[0].config
    assert runner.kv_caches[0][0].shape[2] == max(1, hf_config.num_key_value_heads // tp)  # this rank's KV heads
    assert len(runner.kv_caches) == len(runner.stage.layers)  # and its stage's layers
    assert _generate(llm) == want
    if tp > 1:  # the ranks share this host: their all-reduces went through shared memory
        assert runner.tp.shared is not None and runner.tp.shared.calls > 0
    assert runner.num_kv_blocks > 1  # grown from one block to the batch's need, on every rank (ResizePool)
    llm.engine.close()
    assert not any(worker.is_alive() for worker in runner.workers)


@pytest.fixture(scope="module")
def tp_server(models):
    """A TP=2 engine behind the HTTP server, shared by the two tests below (the second kills a rank: last)."""
    _, directory = models("llama_head64")
    engine = LLMEngine(EngineConfig.from_options(model=str(directory), tensor_parallel_size=2, num_kv_blocks=64,
                                                 **OPTIONS))  # fmt: skip
    server = start_server(engine)
    try:
        yield engine, server
    finally:
        server.stop()
        engine.close()


def test_over_http(models, tp_server):
    hf, directory = models("llama_head64")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    _, server = tp_server
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == text_after(tokenizer, prompt, hf_greedy(hf, prompt, MAX_TOKENS))


def test_a_killed_rank_ends_every_request_with_an_error_naming_it(tp_server):
    engine, server = tp_server
    replies: list[httpx.Response] = []
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    def ask() -> None:
        replies.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60))

    askers = [threading.Thread(target=ask) for _ in range(2)]
    steps = engine.num_steps  # the HTTP test's steps before these
    for asker in askers:
        asker.start()
    deadline = time.monotonic() + 30
    while engine.num_steps < steps + 3:  # both requests running
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.01)
    pid = engine.runner.workers[0].pid
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    for asker in askers:
        asker.join(30)
    assert time.monotonic() - killed < 10, "the requests did not end within seconds"
    assert len(replies) == 2 and all(reply.status_code >= 500 for reply in replies), [r.text for r in replies]
    assert all(f"rank 1 (pid {pid}) died (exit code -9)" in reply.text for reply in replies), replies[0].text
    after = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
    assert after.status_code >= 500  # the engine is down, and says so


def test_a_killed_rank_fails_the_offline_step(models, monkeypatch):
    """Here the ranks all-reduce through gloo (the HTTP test above: shared memory): either notices a dead peer."""
    monkeypatch.setenv("BATCHSERVE_SHARED_ALLREDUCE", "0")
    _, directory = models("qwen3")
    llm = LLM(str(directory), tensor_parallel_size=2, num_kv_blocks=64, **OPTIONS)
    engine = llm.engine
    for prompt in PROMPTS:
        engine.add_prompt(None, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=500, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.runner.tp.shared is None
    worker = engine.runner.workers[0]
    worker.kill()
    start = time.monotonic()
    with pytest.raises(RankDiedError, match=rf"rank 1 \(pid {worker.pid}\) died \(exit code -9\)"):
        for _ in range(100):
            engine.step()
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tp_size": 3}, "tensor_parallel_size 3 does not divide the model's num_attention_heads 2"),
        ({"pipeline_parallel_size": 3}, "pipeline_parallel_size 3 is more than the model's num_hidden_layers 2"),
        ({"tensor_parallel_size": 2, "quantization": "int8"}, "the ranks load their shards as float weights"),
        (
            {"pp_size": 2, "speculative_config": {"method": "ngram"}},
            "pipeline_parallel_size > 1 with speculative_config",
        ),
    ],
)
def test_a_split_the_model_cannot_take_is_refused_before_any_rank_starts(models, options, message):
    _, directory = models("llama_head64")
    with pytest.raises(ConfigError, match=re.escape(message)):
        LLM(str(directory), **{**OPTIONS, **options})
    # no rank started (other children of this worker process, a grammar pool of an earlier test, may live on)
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("batchserve-tp-rank")]
