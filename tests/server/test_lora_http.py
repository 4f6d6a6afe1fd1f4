"""LoRA adapters over HTTP on a tiny random base: `model` names the adapter and concurrent requests of several
adapters and the base equal transformers + PEFT's tokens; /v1/models lists adapters with their parent; an unknown
one is a 404 naming it; adapters load and unload at run time only behind --allow-runtime-lora-updating."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from batchserve.engine.llm_engine import LLMEngine
from tests.server.live import start_server
from tests.tiny_loras import make_adapters, peft_greedy
from tests.tiny_models import hf_greedy, tiny_checkpoint

PROMPTS = {"sql": [5, 9, 14, 3, 77], "poet": [40, 41, 42, 8], "base": [11, 12, 13, 60, 61, 62]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model, base_dir = tiny_checkpoint(tmp_path_factory, "qwen3", "lora_http_base")
    hf_model.generation_config.eos_token_id = None
    adapters = make_adapters(base_dir, tmp_path_factory.mktemp("http_adapters"), names=("sql", "poet", "chat"))
    return hf_model, base_dir, adapters


def serve(base_dir, adapters, **options):
    engine = LLMEngine.from_options(
        model=str(base_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=128,
        lora_modules=f"sql={adapters['sql'].folder} poet={adapters['poet'].folder}", **options,
    )  # fmt: skip
    return start_server(engine, served_model_name="base")


@pytest.fixture(scope="module")
def server(tiny):
    live = serve(tiny[1], tiny[2], allow_runtime_lora_updating=True)
    yield live
    live.stop()


def complete(url, model, prompt):
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    # the word-level tokenizer's text: "w59 w75 ..." (tests/tiny_models.py)
    return answer["model"], [int(word[1:]) for word in answer["choices"][0]["text"].split()]


def test_model_names_the_adapter_in_concurrent_requests(server, tiny):
    hf_model, _, adapters = tiny
    jobs = [(name, PROMPTS[name]) for name in ("sql", "poet", "base")] * 2
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: complete(server.url, *job), jobs))
    for (name, prompt), (model, tokens) in zip(jobs, replies):
        assert model == name
        expected = hf_greedy(hf_model, prompt, 8) if name == "base" else peft_greedy(adapters[name], prompt, 8)
        assert tokens == expected, name


def test_models_lists_each_adapter_with_its_parent(server, tiny):
    cards = {card["id"]: card for card in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert cards["base"]["parent"] is None
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == str(tiny[2]["sql"].folder)
    assert cards["poet"]["parent"] == "base"


def test_an_unknown_adapter_is_a_404_naming_it(server):
    body = {"model": "no-such-adapter", "prompt": [5, 6], "max_tokens": 2}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and "'no-such-adapter'" in error["message"]


def test_load_and_unload_at_run_time(server, tiny):
    _, _, adapters = tiny
    load = {"lora_name": "chat", "lora_path": str(adapters["chat"].folder)}
    reply = httpx.post(server.url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert reply.status_code == 200, reply.text
    assert complete(server.url, "chat", PROMPTS["sql"])[1] == peft_greedy(adapters["chat"], PROMPTS["sql"], 8)
    again = httpx.post(server.url + "/v1/load_lora_adapter", json=load | {"lora_path": "/nowhere"}, timeout=10)
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    bad = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"}, timeout=10)
    assert bad.status_code == 400 and "is not a folder" in bad.json()["error"]["message"]
    reply = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=10)
    assert reply.status_code == 200, reply.text
    body = {"model": "chat", "prompt": [5, 6], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=10).status_code == 404
    gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_run_time_updates_are_off_unless_allowed(tiny):
    live = serve(tiny[1], tiny[2])
    try:
        load = {"lora_name": "chat", "lora_path": str(tiny[2]["chat"].folder)}
        reply = httpx.post(live.url + "/v1/load_lora_adapter", json=load, timeout=10)
        assert reply.status_code == 403 and "--allow-runtime-lora-updating" in reply.json()["error"]["message"]
    finally:
        live.stop()


def test_metrics_name_the_adapters(server):
    complete(server.url, "sql", PROMPTS["sql"])
    server.wait_idle()
    text = httpx.get(server.url + "/metrics", timeout=10).text
    info = [line for line in text.splitlines() if line.startswith("batchserve:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
    assert 'running_lora_adapters=""' in info[0]  # idle now: the last step ran the request to its end
    running = {line.split('lora_name="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith("batchserve:lora_requests_running{")}  # fmt: skip
    assert set(running) >= {"sql", "poet"} and not any(running.values())


def test_grpc_names_the_adapter_by_its_field(server, tiny):
    import grpc

    from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
    from tests.server.grpc_live import LiveGrpc

    hf_model, _, adapters = tiny
    live = LiveGrpc(server.async_engine, ["base"])
    try:
        sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for name in ("sql", ""):
            request = pb.GenerateRequest(tokens=pb.TokenIds(ids=PROMPTS["sql"]), sampling=sampling, lora_name=name)
            (reply,) = live.generation.Generate(request, timeout=60)
            expected = (
                peft_greedy(adapters["sql"], PROMPTS["sql"], 8) if name else hf_greedy(hf_model, PROMPTS["sql"], 8)
            )
            assert list(reply.token_ids) == expected, name
        unknown = pb.GenerateRequest(tokens=pb.TokenIds(ids=[5]), sampling=sampling, lora_name="nope")
        with pytest.raises(grpc.RpcError) as info:
            list(live.generation.Generate(unknown, timeout=30))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in info.value.details()
    finally:
        live.stop()


def test_kserve_generate_names_the_adapter_by_lora_task_id(server, tiny):
    hf_model, _, adapters = tiny
    text = " ".join(f"w{i}" for i in PROMPTS["poet"])  # the word-level tokenizer's words: the prompt's ids
    for task_id, expected in ((2, peft_greedy(adapters["poet"], PROMPTS["poet"], 8)),
                              (None, hf_greedy(hf_model, PROMPTS["poet"], 8))):  # fmt: skip
        body = {"text_input": text, "max_tokens": 8, "temperature": 0.0} | (
            {"lora_task_id": task_id} if task_id else {}
        )
        reply = httpx.post(server.url + "/v2/models/base/generate", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert [int(word[1:]) for word in reply.json()["text_output"].split()] == expected, task_id
    missing = httpx.post(server.url + "/v2/models/base/generate", json={"text_input": text, "max_tokens": 2,
                                                                      "lora_task_id": 99}, timeout=30)  # fmt: skip
    assert missing.status_code == 404 and "lora_task_id 99" in missing.text
