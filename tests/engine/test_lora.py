"""LoRA adapters through the whole engine on tiny random bases of three families: greedy float32 tokens of each
adapter, in one batch mixed with the base model and the other adapters, equal transformers + PEFT's one prompt at a
time (unmerged and merged), every step in the native decoder loop where it is built; the max_loras limit in every step, slots and host copies reused (LRU), prefix caching
per adapter, and adapters loaded and unloaded while the engine runs."""

from __future__ import annotations

import dataclasses
import random

import pytest

from batchserve import LLM, LoRARequest
from batchserve.engine.llm_engine import LLMEngine
from batchserve.engine.lora_registry import UnknownAdapterError
from batchserve.models.gemma import GemmaDecoderLayer
from batchserve.models.llama import DecoderLayer
from batchserve.sampling_params import SamplingParams
from batchserve.serving.live_stats import LiveStats
from tests.tiny_loras import make_adapters, peft_greedy
from tests.tiny_models import VOCAB, hf_greedy, tiny_checkpoint


def python_layer_ran(*args, **kwargs):
    raise AssertionError("a step took the Python layers")


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
FAMILIES = ["llama", "qwen3", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    hf_model, base_dir = tiny_checkpoint(tmp_path_factory, request.param, f"lora_{request.param}")
    hf_model.generation_config.eos_token_id = None
    adapters = make_adapters(base_dir, tmp_path_factory.mktemp(f"adapters_{request.param}"))
    return hf_model, base_dir, adapters


def prompts(count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.choice([3, 9, 21, 40]))] for _ in range(count)]


def lora_requests(adapters):
    return {name: LoRARequest(name, i, str(a.folder)) for i, (name, a) in enumerate(adapters.items(), start=1)}


def test_a_mixed_batch_equals_peft_one_prompt_at_a_time(family, monkeypatch):
    hf_model, base_dir, adapters = family
    loras = lora_requests(adapters)
    names = [None, "sql", "poet", "chat", "sql", None, "poet", "chat"]
    batch = prompts(len(names))
    llm = LLM(model=str(base_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=3, num_kv_blocks=256)
    if llm.engine.runner.model.decoder_loop is not None:  # every step, adapters or not, in the native loop
        for layer_class in (DecoderLayer, GemmaDecoderLayer):
            monkeypatch.setattr(layer_class, "forward", python_layer_ran)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False,
        lora_request=[None if n is None else loras[n] for n in names],
    )  # fmt: skip
    for name, prompt, out in zip(names, batch, outs):
        got = out.outputs[0].token_ids
        if name is None:
            assert got == hf_greedy(hf_model, prompt, 10)
            continue
        assert got == peft_greedy(adapters[name], prompt, 10), name
        assert got == peft_greedy(adapters[name], prompt, 10, merged=True), name
    # each adapter changes what the model says
    for name in adapters:
        with_adapter = [o.outputs[0].token_ids for n, o in zip(names, outs) if n == name]
        base = [hf_greedy(hf_model, p, 10) for n, p in zip(names, batch) if n == name]
        assert with_adapter != base, name


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_max_loras_holds_every_step_with_slots_and_host_copies_reused(family):
    """Three adapters, one slot, one host copy: every step runs one adapter at most; adapters take the slot in turn
    and are read again from their folders; tokens still equal PEFT's."""
    hf_model, base_dir, adapters = family
    loras = lora_requests(adapters)
    engine = LLMEngine.from_options(
        model=str(base_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
        num_kv_blocks=256,
    )  # fmt: skip
    for lora in loras.values():
        engine.add_lora(lora)
    assert engine.loras.loaded_names() == (list(loras)[-1],)  # one host copy: the latest (what a replica reports)
    names = ["sql", "poet", None, "chat", "poet", "sql", None, "chat"]
    batch = prompts(len(names), seed=1)
    for i, (name, prompt) in enumerate(zip(names, batch)):
        engine.add_request(_request(engine, str(i), prompt, name))
    outputs: dict[int, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        scheduled_before = engine.runner.lora.req_lora.copy()
        for out in engine.step():
            outputs.setdefault(int(out.request_id), []).extend(out.delta_token_ids)
        step = engine.scheduler.last_step.output
        ids = {(scheduled_before | engine.runner.lora.req_lora).get(r, 0) for r in step.num_scheduled_tokens}
        assert len(ids - {0}) <= 1
    assert engine.runner.lora.num_loads > 3  # host copies dropped and read again
    for i, (name, prompt) in enumerate(zip(names, batch)):
        expected = hf_greedy(hf_model, prompt, 10) if name is None else peft_greedy(adapters[name], prompt, 10)
        assert outputs[i] == expected, (i, name)


def _request(engine, request_id, prompt, lora_name):
    params = dataclasses.replace(GREEDY, lora_name=lora_name)
    return engine.requests.from_prompt(request_id, {"prompt_token_ids": prompt}, params)


def _run_alone(engine, request_id, prompt, lora_name):
    engine.add_request(_request(engine, request_id, prompt, lora_name))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.delta_token_ids)
    return tokens


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_prefix_caching_never_crosses_adapters(family):
    """The same long prompt under the base model, then each adapter, then an adapter again: each run equals its own
    reference (a K/V block of another adapter would change it), and only the repeat finds cached blocks."""
    hf_model, base_dir, adapters = family
    engine = LLMEngine.from_options(
        model=str(base_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=256
    )
    for lora in lora_requests(adapters).values():
        engine.add_lora(lora)
    prompt = prompts(1, seed=3)[0] * 2  # 80 tokens: five full blocks
    assert _run_alone(engine, "base", prompt, None) == hf_greedy(hf_model, prompt, 10)
    for name in ("sql", "poet"):
        hits = engine.scheduler.kv.prefix_hits
        assert _run_alone(engine, name, prompt, name) == peft_greedy(adapters[name], prompt, 10)
        assert engine.scheduler.kv.prefix_hits == hits  # nothing of the base's or the other adapter's blocks
    assert _run_alone(engine, "sql again", prompt, "sql") == peft_greedy(adapters["sql"], prompt, 10)
    assert engine.scheduler.kv.prefix_hits > hits  # its own blocks are found


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_adapters_load_and_unload_while_requests_run(family):
    hf_model, base_dir, adapters = family
    engine = LLMEngine.from_options(
        model=str(base_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
        lora_modules=f"sql={adapters['sql'].folder}", num_kv_blocks=256,
    )  # fmt: skip
    assert [lora.lora_name for lora in engine.list_loras()] == ["sql"]
    prompt = prompts(1, seed=4)[0]
    engine.add_request(_request(engine, "running", prompt, "sql"))
    outputs = {"running": [t for out in engine.step() for t in out.delta_token_ids]}
    engine.add_lora(LoRARequest("poet", 7, str(adapters["poet"].folder)))  # under traffic
    engine.add_request(_request(engine, "new", prompt, "poet"))
    engine.remove_lora("sql")  # its running request finishes with it
    with pytest.raises(UnknownAdapterError, match="'sql' does not exist"):
        engine.add_request(_request(engine, "late", prompt, "sql"))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.delta_token_ids)
    assert outputs["running"] == peft_greedy(adapters["sql"], prompt, 10)
    assert outputs["new"] == peft_greedy(adapters["poet"], prompt, 10)
    assert 1 not in engine.runner.lora.loaded  # the unloaded adapter's copy went with its last request


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_finished_requests_name_their_adapter_on_the_dashboard(family):
    """Each finished request's delta names its adapter; the dashboard's data counts each adapter's requests (the
    base model's under "") with their TTFT and TPOT percentiles."""
    _, base_dir, adapters = family
    llm = LLM(model=str(base_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=64)
    engine = llm.engine
    for lora in lora_requests(adapters).values():
        engine.add_lora(lora)
    stats = LiveStats()
    for name in ("sql", "sql", None, "poet"):
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, lora_name=name)
        engine.add_prompt(None, {"prompt_token_ids": [5, 6, 7]}, params)
    finished = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        finished += [(o.lora_name, o.request_id) for o in outputs if o.finished]
        stats.on_step(engine, outputs)
    assert sorted(name or "" for name, _ in finished) == ["", "poet", "sql", "sql"]
    snapshot = stats.snapshot(with_requests=True)
    assert sorted(r["adapter"] or "" for r in snapshot["requests"]) == ["", "poet", "sql", "sql"]
    by_adapter = snapshot["latency"]["by_adapter"]
    assert {name: a["count"] for name, a in by_adapter.items()} == {"": 1, "poet": 1, "sql": 2}
    assert all(a["ttft_s"]["p50"] is not None and a["tpot_s"]["p50"] is not None for a in by_adapter.values())
