"""Fixtures of the one set of test doubles (tests/doubles.py): `tokenizer` (the byte-level one) and `make_engine`
(the real LLMEngine over the FakeRunner). Non-fixture code imports the same things from tests.doubles."""

from __future__ import annotations

import gc
import os

# Before torch loads its OpenMP runtime (read once, then): a thread waiting for work sleeps instead of spinning. The
# suite runs one worker per core and each worker's torch as many threads again, so a spinning waiter takes the core
# another worker's thread needs (tiny-model tests on a busy 2-core host: half the CPU time, under half the wall time).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The weights' layouts and the KV pool on ordinary pages, in this process and the servers it starts: on the VMs this
# suite runs on, a 2 MiB page's first touch costs the host's backing of all of it (a float32 default-model load: 3.0
# CPU-s of system time on 2 MiB pages against 1.1 on 4 KiB), and the suite loads models many times for a few tokens
# each. What the pages are for, a long decode, is measured by the benchmarks; the tests of the pages themselves turn
# them on (`huge_pages_on`).
os.environ.setdefault("BATCHSERVE_HUGE_PAGES", "0")

import functools  # noqa: E402

import pytest  # noqa: E402

from tests import doubles  # noqa: E402
from tests.doubles import (  # noqa: E402
    LETTERS,
    FakeRunner,
    byte_tokenizer,
    reference_generation,
    run_to_completion,
    tiny_model_config,
)
from tests.file_order import sort_longest_first  # noqa: E402

__all__ = ["LETTERS", "FakeRunner", "byte_tokenizer", "reference_generation", "run_to_completion", "tiny_model_config"]


def _share_httpx_tls_context() -> None:
    """Every httpx client of the tests (each httpx.get() or .post() makes one, and the openai client its own) builds a
    TLS context from certifi's bundle: ~30 ms of CPU a client, for requests that all go to loopback over plain HTTP.
    The default context is built once per process here and shared (the tests never change it), as a client kept
    for the whole run would share it; any other `verify` or a client certificate still gets its own."""
    try:
        from httpx._transports import default as transports
    except ImportError:
        return
    build = getattr(transports, "create_ssl_context", None)
    if build is None:
        return
    shared = functools.cache(lambda trust_env, cafile, capath: build(verify=True, trust_env=trust_env))

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return shared(trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return build(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context


_share_httpx_tls_context()


@pytest.fixture(scope="session")
def tokenizer():
    """The byte-level tokenizer: any text, a-z = ids 0-25, ChatML specials and a chat template."""
    return byte_tokenizer()


@pytest.fixture
def huge_pages_on(monkeypatch):
    """2 MiB pages asked for in this test, as outside the suite (the suite turns them off: the top of this file);
    skipped where the host cannot give them."""
    from batchserve.host import huge_pages

    if huge_pages.host_cannot() is not None:
        pytest.skip(huge_pages.host_cannot())
    monkeypatch.setenv("BATCHSERVE_HUGE_PAGES", "1")


@pytest.fixture(name="make_engine")
def make_engine_fixture(tokenizer):
    """make_engine(config=None, *, delay_s=0.0, runner_vocab=26, **options) -> the real LLMEngine over the
    FakeRunner, sharing the session's tokenizer."""

    def make(config=None, **options):
        return doubles.make_engine(config, **({"tokenizer": tokenizer} | options))

    return make


def pytest_collection_modifyitems(config, items):
    """The longest files first, each file's tests together and in their order (tests/file_order.py)."""
    sort_longest_first(items, config.rootpath)


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, Ray, the servers' stacks: several hundred thousand objects)
    lives as long as the process: frozen out of the collector, so that each full collection during the tests walks
    only what the tests made (it was a fifth of a scheduler test's time)."""
    gc.collect()
    gc.freeze()
