"""`batchserve bench --model <the id /v1/models gives>` against a batchserve server, as vLLM's bench takes --model."""

from __future__ import annotations

import json

import pytest

from batchserve.bench import cli
from batchserve.models.registry import ModelLoadError
from tests.server.fakes import fake_engine
from tests.server.live import start_server

SERVED = "SmolLM2-135M-Instruct"  # what `batchserve serve` names its default model


@pytest.fixture(scope="module")
def server():
    live = start_server(fake_engine(delay_s=0.002), served_model_name=SERVED)
    yield live
    live.stop()


def test_bench_takes_the_model_id_the_server_serves(server, tmp_path):
    rc = cli.main(["--base-url", server.url, "--model", SERVED, "--num-prompts", "3", "--dataset-name", "random",
                   "--random-input-len", "8", "--random-output-len", "4", "--no-progress", "--no-plots",
                   "--result-dir", str(tmp_path), "--num-warmups", "0"])  # fmt: skip
    assert rc == 0
    (run_dir,) = tmp_path.iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["runs"]["http"]["completed"] == 3
    requests = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert len(requests) == 3 and not any(r.get("error") for r in requests)


def test_a_model_neither_local_nor_served_names_what_the_server_serves(server):
    args = cli.build_parser().parse_args(["--base-url", server.url, "--model", "no-such-model"])
    with pytest.raises(ModelLoadError, match=f"serves {SERVED}"):
        cli._http_tokenizer(args)
    args = cli.build_parser().parse_args(["--base-url", server.url, "--model", SERVED])
    cli._http_tokenizer(args)
    assert args.model_name == SERVED  # the requests' model field, as vLLM's bench sends it
