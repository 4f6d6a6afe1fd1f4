"""Under overload the front end answers without waiting on the engine: a full queue's 503 comes back while a step
is still running, and a large body is parsed (and /detokenize decoded) off the event loop."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.fakes import fake_engine
from tests.server.live import start_server

STEP_S = 0.4


@pytest.fixture(scope="module")
def server():
    # one request runs at a time, each step takes STEP_S, two may wait
    s = start_server(fake_engine(delay_s=STEP_S, max_batch_size=1, max_waiting_requests=2))
    yield s
    s.stop()


def test_a_full_queue_is_refused_without_waiting_for_the_step(server):
    body = {"prompt": "a", "max_tokens": 6, "ignore_eos": True}
    # the first runs for seconds of steps; the two behind it only fill the queue, then take a step each, not six
    filling = [threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                kwargs={"json": {**body, "max_tokens": 6 if i == 0 else 1}, "timeout": 60})
               for i in range(3)]  # fmt: skip
    for thread in filling:
        thread.start()
        time.sleep(0.05)
    time.sleep(STEP_S)  # one running, two waiting, a step in progress
    refusals = []
    for _ in range(5):
        start = time.monotonic()
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        refusals.append(time.monotonic() - start)
        assert reply.status_code == 503, reply.text
    health_start = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    assert time.monotonic() - health_start < STEP_S / 2
    assert max(refusals) < STEP_S / 2, refusals  # before: each waited for the step in progress to end
    for thread in filling:
        thread.join()
    server.wait_idle()


def test_detokenize_goes_through_the_gil_free_call_with_the_same_text():
    from batchserve.serving.decoding import decode_releasing_gil
    from tests.doubles import byte_tokenizer

    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("Héllo , world !<|im_end|> again") * 50
    calls = []
    backend = tokenizer._tokenizer
    original = backend.decode_batch

    class Spy:  # the Rust object's attributes are read-only: wrap it
        def __getattr__(self, name):
            return getattr(backend, name)

        def decode_batch(self, *args, **kwargs):
            calls.append(len(args[0][0]))
            return original(*args, **kwargs)

    tokenizer.clean_up_tokenization_spaces = False
    tokenizer._tokenizer = Spy()
    try:
        assert decode_releasing_gil(tokenizer, ids) == byte_tokenizer().decode(ids) and calls == [len(ids)]
        tokenizer.clean_up_tokenization_spaces = True  # Python-side clean-up: decode itself, for the same text
        assert decode_releasing_gil(tokenizer, ids) == tokenizer.decode(ids) and calls == [len(ids)]
    finally:
        tokenizer._tokenizer = backend
