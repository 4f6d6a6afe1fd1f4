"""`n > 1` end to end on SmolLM2-135M-Instruct: n child requests sharing the prompt's KV blocks (one prefill)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

LONG = "Tell me a story about a lighthouse keeper who finds a message in a bottle on the shore at dawn. " * 3


def _metric(real_server, name: str) -> float:
    return sum(v for k, v in real_server.metrics().items() if k.startswith(f"batchserve:{name}"))


def test_n4_chat_returns_four_choices_counts_the_prompt_once_and_prefills_once(real_server, client):
    model, messages = real_server.model_id(), [{"role": "user", "content": LONG}]
    one = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    real_server.wait_idle()
    hits_before = _metric(real_server, "prefix_cache_hits")
    many = client.chat.completions.create(model=model, messages=[{"role": "user", "content": LONG + " Go."}], n=4,
                                          max_tokens=8, temperature=1.0, seed=5)  # fmt: skip
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert all(c.message.content for c in many.choices)
    assert many.usage.prompt_tokens < 2 * one.usage.prompt_tokens  # once, not four times
    assert 4 <= many.usage.completion_tokens <= 4 * 8  # every choice's output counted
    real_server.wait_idle()
    # the three later choices found the prompt's full blocks in the prefix cache
    block = 16
    assert (
        _metric(real_server, "prefix_cache_hits") - hits_before >= 3 * (many.usage.prompt_tokens // block - 1) * block
    )


def test_greedy_choices_are_equal_and_completions_number_prompt_major(real_server, client):
    out = client.completions.create(model=real_server.model_id(), prompt=["The sea is", "A cat"], n=2, max_tokens=6,
                                    temperature=0, echo=True)  # fmt: skip
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1] and by_index[0].startswith("The sea is")
    assert by_index[2] == by_index[3] and by_index[2].startswith("A cat")
    assert 4 <= out.usage.completion_tokens <= 4 * 6
    assert out.usage.prompt_tokens == sum(len(httpx.post(real_server.url + "/tokenize", json={"prompt": p}).json()["tokens"])
                                          for p in ("The sea is", "A cat"))  # fmt: skip


def test_streamed_choices_assemble_per_index(real_server, client):
    model = real_server.model_id()
    args = dict(model=model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=6, temperature=0)
    full = client.chat.completions.create(n=3, **args)
    texts = {0: "", 1: "", 2: ""}
    roles = set()
    for chunk in client.chat.completions.create(n=3, stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1, 2}
    assert texts == {c.index: c.message.content for c in full.choices}


def test_n_out_of_range_is_a_400(real_server):
    r = httpx.post(real_server.url + "/v1/completions", json={"prompt": "x", "n": 0, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
