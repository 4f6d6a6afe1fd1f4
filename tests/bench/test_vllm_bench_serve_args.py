"""`batchserve bench` takes `vllm bench serve`'s arguments for the serve benchmark: backend names openai,
vllm and openai-chat, --endpoint, --host/--port, random and ShareGPT-format datasets from a local file, --goodput,
--num-warmups, --disable-tqdm, and vLLM's defaults against a server (no warm-up, ignore-eos off, text prompts).
Both clients' argument sets go through the parser, and short runs against the model-free engine's server."""

from __future__ import annotations

import json

import pytest

from batchserve.bench import cli
from batchserve.bench.args import make_requests
from tests.server.fakes import fake_engine
from tests.server.live import start_server


@pytest.fixture(scope="module")
def server():
    live = start_server(fake_engine(delay_s=0.001), served_model_name=["fake"])
    yield live
    live.stop()


def vllm_argv(host: str, port: int, result_dir, backend: str = "openai-chat") -> list[str]:
    """As a vLLM user writes it (vLLM's docs' serve benchmark), small."""
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    return ["--backend", backend, "--endpoint", endpoint, "--host", host, "--port", str(port),
            "--served-model-name", "fake", "--dataset-name", "random", "--random-input-len", "8",
            "--random-output-len", "5", "--random-range-ratio", "0.0", "--num-prompts", "6", "--seed", "0",
            "--request-rate", "inf", "--burstiness", "1.0", "--max-concurrency", "3",
            "--percentile-metrics", "ttft,tpot,itl", "--goodput", "ttft:5000", "tpot:1000", "--num-warmups", "2",
            "--disable-tqdm", "--save-result", "--result-dir", str(result_dir)]  # fmt: skip


def ours_argv(url: str, output_dir) -> list[str]:
    return ["--base-url", url, "--model-name", "fake", "--workload", "uniform", "--input-len", "8", "--output-len",
            "5", "--spread", "0", "--num-requests", "6", "--max-concurrency", "3", "--percentile-metrics",
            "ttft,tpot,itl", "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000", "--warmup-requests", "2",
            "--no-progress", "--output-dir", str(output_dir)]  # fmt: skip


def parsed(argv: list[str]):
    args = cli.build_parser().parse_args(argv)
    cli.normalize(args)
    return args


def test_both_argument_sets_describe_the_same_run(tmp_path):
    vllm, ours = parsed(vllm_argv("127.0.0.1", 8000, tmp_path, "openai")), parsed(ours_argv("http://x", tmp_path))
    for name in ("workload", "input_len", "output_len", "spread", "num_requests", "max_concurrency", "slo_ttft_ms",
                 "slo_tpot_ms", "warmup_requests", "no_progress", "output_dir", "model_name", "percentile_metrics"):  # fmt: skip
        assert getattr(vllm, name) == getattr(ours, name), name
    assert cli.endpoint_of(vllm, vllm.backend) == cli.endpoint_of(ours, ours.backend) == "/v1/completions"


def test_vllms_defaults_against_a_server_and_ours_offline(tokenizer):
    served = parsed(["--base-url", "http://x", "--dataset-name", "random"])
    assert (served.input_len, served.output_len, served.spread) == (1024, 128, 0.0)  # vLLM's random defaults
    assert served.warmup_requests is None and served.prompt_format is None  # main() makes them 0 and text
    served.input_len, served.output_len = 4, 3
    assert not any(r.ignore_eos for r in make_requests(served, tokenizer, 3, 0))  # vLLM: stop at EOS
    offline = parsed(["--offline", "--input-len", "4", "--output-len", "3"])
    assert all(r.ignore_eos for r in make_requests(offline, tokenizer, 3, 0))  # offline runs compare like for like


@pytest.mark.parametrize("goodput,words", [(["e2el:100"], "ttft:MS and tpot:MS"), (["ttft:fast"], "'fast'")])
def test_a_goodput_we_cannot_measure_is_refused(goodput, words):
    args = cli.build_parser().parse_args(["--base-url", "http://x", "--goodput", *goodput])
    with pytest.raises(ValueError, match=words):
        cli.normalize(args)


@pytest.mark.parametrize("backend", ["openai-chat", "openai"])
def test_vllms_serve_benchmark_runs_against_our_server(server, tokenizer, monkeypatch, tmp_path, capsys, backend):
    monkeypatch.setattr(cli, "_http_tokenizer", lambda args: tokenizer)
    host, port = server.url.removeprefix("http://").split(":")
    assert cli.main(vllm_argv(host, int(port), tmp_path, backend)) == 0
    out = capsys.readouterr().out
    assert "warm-up (not timed): 2 requests" in out and "Goodput" in out
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    run = summary["runs"][backend]
    assert run["completed"] == 6 and run["failed"] == 0 and run["total_output_tokens"] > 0, run


def test_a_sharegpt_format_file_is_a_dataset(server, tokenizer, monkeypatch, tmp_path, capsys):
    dataset = tmp_path / "sharegpt.json"
    turns = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i}."},
                                {"from": "gpt", "value": "It is a number. " * 2}]} for i in range(8)]  # fmt: skip
    dataset.write_text(json.dumps(turns))
    monkeypatch.setattr(cli, "_http_tokenizer", lambda args: tokenizer)
    argv = ["--base-url", server.url, "--backend", "vllm", "--dataset-name", "sharegpt", "--dataset-path",
            str(dataset), "--num-prompts", "4", "--disable-tqdm", "--no-save-result"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "4 requests" in capsys.readouterr().out


def test_an_unknown_backend_names_the_ones_there_are(capsys):
    assert cli.main(["--base-url", "http://x", "--backend", "tgi", "--disable-tqdm"]) == 2
    assert "openai-chat" in capsys.readouterr().err
