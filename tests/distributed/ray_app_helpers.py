"""Helpers of tests/distributed/test_ray_app.py: the tiny model its Ray app serves, free ports for the ingress, and the
HTTP waits that poll the app."""

from __future__ import annotations

import functools
import json
import random
import socket
import time
from pathlib import Path

import httpx

from tests.tiny_models import build_hf_model

APP_CONTEXT = 4096  # positions the app's model takes: 256 KV blocks of 16
APP_WORDS = 48  # the app tokenizer's words, each twice: alone and after a space (VOCAB 96)


def words(*ids: int) -> str:
    """A prompt in the app model's vocabulary (its tokenizer maps any other word to w0)."""
    return " ".join(f"w{i % APP_WORDS}" for i in ids)


def save_spaced_tokenizer(directory: Path) -> None:
    """A word-level tokenizer whose tokens carry the space before them, as byte-level BPE tokens do: a token's text
    does not depend on the one before it, so a request moved to another replica mid-stream (prompt plus the tokens
    streamed so far) goes on with the same text."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    space = "\u2581"
    vocab = {f"w{i}": i for i in range(APP_WORDS)} | {f"{space}w{i}": APP_WORDS + i for i in range(APP_WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="never")
    tokenizer.decoder = decoders.Metaspace(replacement=space, prepend_scheme="never")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)


def save_app_model(directory: Path) -> None:
    """A tiny random Llama with the spaced tokenizer, its context widened to APP_CONTEXT (rotary positions, no table
    to grow), so that a stream can outlive the test's waits unless it is aborted."""
    build_hf_model("llama", directory)
    save_spaced_tokenizer(directory)
    config_path = Path(directory) / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "max_position_embeddings": APP_CONTEXT}))


def quiet_ports(count: int) -> list[int]:
    """Free ports below the kernel's ephemeral range (32768-60999) and above Ray's worker ports (10002-19999): Ray's
    processes, started between a pick and the ingress's bind, take theirs from the ephemeral range."""
    rng, ports = random.Random(), []
    while len(ports) < count:
        port = rng.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


@functools.cache
def polling_client() -> httpx.Client:
    """The client of the waits that poll: httpx.get() builds a client (and its TLS context) per call, ~30 ms of CPU,
    taken from the replicas being waited for."""
    return httpx.Client(timeout=30)


def replica_metric(base_url: str, name: str, label: str = "") -> dict[str, float]:
    """{replica: value} of one series on the ingress's /metrics (the lines holding `label`, if given)."""
    values: dict[str, float] = {}
    for line in polling_client().get(base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line and label in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            values[replica] = values.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
