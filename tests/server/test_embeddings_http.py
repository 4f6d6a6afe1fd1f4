"""The pooling routes over HTTP (docs/embeddings.md): the official openai client's embeddings.create (float and
base64, Matryoshka dimensions, token arrays) equals sentence-transformers on the same folder; /v1/score and
/v1/rerank on a cross-encoder equal transformers' ForSequenceClassification; /v1/models says the runner; bad input
is a 400 naming the field, and a generation server says which server to run."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import transformers

from batchserve.engine.llm_engine import LLMEngine
from tests.lazy import (
    openai,
    sentence_transformers,  # noqa: E402
)
from tests.pooling_models import classifier_folder, embedding_folder, words
from tests.server.live import start_server

TOLERANCE = 1e-5
TEXTS = [words(seed, 4 + 6 * seed) for seed in range(5)]


def _engine(folder, **options) -> LLMEngine:
    return LLMEngine.from_options(model=str(folder), dtype="float32", num_kv_blocks=64, max_num_tokens=32, **options)


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    folder = embedding_folder(tmp_path_factory.mktemp("http-embed"))
    live = start_server(_engine(folder), served_model_name=["embedder"])
    reference = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    yield live, reference
    live.stop()


@pytest.fixture(scope="module")
def client(embedding_server):
    return openai.OpenAI(base_url=embedding_server[0].url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_client_embeddings_equal_sentence_transformers(embedding_server, client, encoding_format):
    live, reference = embedding_server
    reply = client.embeddings.create(model="embedder", input=TEXTS, encoding_format=encoding_format)
    vectors = [item.embedding for item in sorted(reply.data, key=lambda d: d.index)]
    if encoding_format == "base64":  # little-endian float32 bytes, as OpenAI sends them
        vectors = [np.frombuffer(base64.b64decode(v), dtype="<f4").copy() for v in vectors]
    got = torch.tensor(np.array(vectors, dtype=np.float32))
    torch.testing.assert_close(got, reference.encode(TEXTS, convert_to_tensor=True), atol=TOLERANCE, rtol=0)
    tokenizer = live.async_engine.tokenizer
    assert reply.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS) == reply.usage.total_tokens
    live.wait_idle()
    engine = live.async_engine.engine
    assert engine.scheduler.kv.pool.num_free_blocks == engine.runner.num_kv_blocks  # the blocks freed


def test_dimensions_and_token_arrays(embedding_server, client):
    live, reference = embedding_server
    ids = live.async_engine.tokenizer(TEXTS[2])["input_ids"]
    reply = client.embeddings.create(model="embedder", input=[ids], dimensions=8)
    expected = torch.nn.functional.normalize(reference.encode([TEXTS[2]], convert_to_tensor=True)[:, :8], dim=1)
    torch.testing.assert_close(torch.tensor([reply.data[0].embedding]), expected, atol=TOLERANCE, rtol=0)
    single = client.embeddings.create(model="embedder", input=ids)  # one token array, not a batch of ints
    assert len(single.data) == 1


def test_models_says_the_runner(embedding_server):
    card = httpx.get(embedding_server[0].url + "/v1/models").json()["data"][0]
    assert (card["runner"], card["convert"]) == ("pooling", "embed")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": words(1, 400)}, "input"),  # over the 256-token context
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], [500]]}, "input"),  # a token id outside the vocabulary
        ({"input": "w1", "dimensions": 0}, "dimensions"),
        ({"input": "w1", "dimensions": 1000}, "dimensions"),
        ({"input": "w1", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "w1", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "w1", "nonsense": 1}, "nonsense"),
    ],
)
def test_bad_embedding_input_is_a_400_naming_the_field(embedding_server, body, param):
    reply = httpx.post(embedding_server[0].url + "/v1/embeddings", json={"model": "embedder", **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    embedding_server[0].wait_idle()
    assert not embedding_server[0].async_engine.engine.has_unfinished_requests()


def test_truncate_prompt_tokens_keeps_the_last_tokens(embedding_server, client):
    live, reference = embedding_server
    text = words(7, 400)
    reply = client.embeddings.create(model="embedder", input=text, extra_body={"truncate_prompt_tokens": 50})
    kept = " ".join(text.split()[-50:])
    expected = reference.encode([kept], convert_to_tensor=True)
    torch.testing.assert_close(torch.tensor([reply.data[0].embedding]), expected, atol=TOLERANCE, rtol=0)


def test_score_on_an_embedding_model_is_the_cosine(embedding_server):
    live, reference = embedding_server
    reply = httpx.post(live.url + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:3]}, timeout=30).json()
    vectors = reference.encode(TEXTS[:3], convert_to_tensor=True)
    expected = [float(vectors[0] @ vectors[i]) for i in (1, 2)]  # normalised: the dot product is the cosine
    assert [d["score"] for d in reply["data"]] == pytest.approx(expected, abs=TOLERANCE)


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory):
    folder = classifier_folder(tmp_path_factory.mktemp("http-rerank"), "qwen3")
    live = start_server(_engine(folder))
    yield live, transformers.AutoModelForSequenceClassification.from_pretrained(folder).float().eval()
    live.stop()


def test_rerank_and_score_equal_transformers(rerank_server):
    live, reference = rerank_server
    tokenizer = live.async_engine.tokenizer
    query, documents = words(3, 5), [words(30 + i, 3 + 4 * i) for i in range(6)]
    with torch.no_grad():
        expected = [
            float(torch.sigmoid(reference(tokenizer(query, d, return_tensors="pt")["input_ids"]).logits[0, 0]))
            for d in documents
        ]
    body = {"query": query, "documents": documents[:3] + [{"text": d} for d in documents[3:]], "top_n": 4}
    reply = httpx.post(live.url + "/v1/rerank", json=body, timeout=30).json()
    order = sorted(range(6), key=lambda i: -expected[i])[:4]
    assert [r["index"] for r in reply["results"]] == order
    assert [r["relevance_score"] for r in reply["results"]] == pytest.approx(
        [expected[i] for i in order], abs=TOLERANCE
    )
    assert reply["results"][0]["document"] == {"text": documents[order[0]]}
    bare = httpx.post(live.url + "/rerank", json={**body, "return_documents": False}, timeout=30).json()
    assert "document" not in bare["results"][0]
    scores = httpx.post(live.url + "/v1/score", json={"text_1": query, "text_2": documents}, timeout=30).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=TOLERANCE)
    refused = httpx.post(live.url + "/v1/embeddings", json={"input": "w1"}, timeout=30)
    assert refused.status_code == 400 and "/v1/score or /v1/rerank" in refused.json()["error"]["message"]
    chat = httpx.post(live.url + "/v1/completions", json={"prompt": "w1", "max_tokens": 2}, timeout=30)
    assert chat.status_code == 400 and "not generation" in chat.json()["error"]["message"]
    for body, param in [({"query": query, "documents": []}, "documents"), ({"query": "", "documents": ["w1"]},
                        "query"), ({"query": query, "documents": ["w1"], "top_n": 0}, "top_n")]:  # fmt: skip
        reply = httpx.post(live.url + "/v1/rerank", json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_a_generation_server_says_which_server_to_run(tmp_path):
    folder = embedding_folder(tmp_path / "gen")
    live = start_server(_engine(folder, runner="generate"))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            client.embeddings.create(model=live.model_id(), input="w1 w2")
        reply = httpx.post(live.url + "/v1/rerank", json={"query": "w1", "documents": ["w2"]}, timeout=30)
        assert reply.status_code == 400 and "--runner pooling" in reply.json()["error"]["message"]
        assert httpx.get(live.url + "/v1/models").json()["data"][0]["runner"] == "generate"
    finally:
        live.stop()
