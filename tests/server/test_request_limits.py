"""Every list and number a request carries has a bound, named in the 400 (docs/limits.md), and bodies are read
strictly: what Python's int() would forgive ("1_0") is refused."""

from __future__ import annotations

import httpx
import pytest
import torch

from batchserve.entrypoints.openai.protocol import MAX_TOKEN_IDS
from batchserve.sampling_params import (
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    InvalidRequestError,
    SamplingParams,
)
from batchserve.worker.sampler import SamplingMetadata
from tests.server.fakes import fake_engine
from tests.server.live import start_server

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server():
    s = start_server(fake_engine(delay_s=0.001))
    yield s
    s.stop()


def refused(server, path, body):
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
        ("top_k", MAX_TOP_K + 1),
        ("top_k", 10**12),
        ("temperature", MAX_TEMPERATURE * 10),
        ("logprobs", 21),
        ("stop", ["x"] * 33),
        ("logit_bias", {str(i): 1.0 for i in range(1025)}),
    ],
)
def test_each_bound_is_named_in_the_error(server, field, value):
    error = refused(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, field: value})
    assert field in (error["param"] or "") and field in error["message"]


@pytest.mark.parametrize("key", ["1_0", " 1", "+1", "\u0661", "-1", "1.0", "99999999999"])
def test_logit_bias_keys_are_plain_decimal_token_ids(server, key):
    error = refused(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "logit_bias": {key: 1.0}})
    assert error["param"] == "logit_bias"


def test_response_format_needs_a_type(server):
    error = refused(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"json_schema": {}}},
    )
    assert "response_format" in error["message"]


def test_token_arrays_are_bounded(server):
    error = refused(server, "/detokenize", {"tokens": [1] * (MAX_TOKEN_IDS + 1)})
    assert error["param"] == "tokens"
    error = refused(server, COMPLETIONS, {"prompt": [[1] * (MAX_TOKEN_IDS // 2 + 1)] * 2, "max_tokens": 2})
    assert error["param"] == "prompt"
    # at the bounds: served (or refused by the engine's context, not by a parse limit)
    ok = httpx.post(
        server.url + COMPLETIONS,
        json={
            "prompt": "hi",
            "max_tokens": 2,
            "logit_bias": {"10": 1.0},
            "stop_token_ids": [i % 250 for i in range(MAX_STOP_TOKEN_IDS)],
        },
        timeout=30,
    )
    assert ok.status_code == 200, ok.text


def test_sampling_params_bounds_hold_for_every_front_end():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert info.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=1e6)


def test_a_long_stop_id_list_is_sorted_once_not_at_every_step():
    params = SamplingParams(max_tokens=8, min_tokens=8, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS, 0, -1)))
    first = params.sorted_stop_token_ids
    build = dict(
        token_ids=[[1, 2]], num_prompt_tokens=[2], eos_token_ids=[0], vocab_size=600, device=torch.device("cpu")
    )
    meta = SamplingMetadata.build([params], **build)
    assert params.sorted_stop_token_ids is first  # cached on the request, not recomputed
    rows, ids = meta.min_tokens_mask
    assert sorted(set(ids.tolist())) == list(range(600)) and set(rows.tolist()) == {0}
