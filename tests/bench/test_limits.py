"""benchmarks/limits.py at tiny sizes: every section runs, prints a figure, its bound and the ratio for each row, a
row that would not fit the memory budget is skipped with its size, and the JSON record names the host."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def limits():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("limits")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, limits):
    import model_scale
    import torch

    folder = tmp_path_factory.mktemp("limits_tiny")
    model_scale.write_checkpoint(model_scale.PRESETS["tiny-llama"], folder, torch.bfloat16)
    return folder


def test_every_section_gives_a_figure_its_bound_and_the_ratio(limits, tiny_model, tmp_path, capsys):
    out = tmp_path / "limits.json"
    record = limits.main(["--model", str(tiny_model), "--contexts", "96", "--batches", "1,2", "--layers", "1",
                          "--eightb-preset", "tiny-llama", "--eightb-batches", "1,4",
                          "--eightb-formats", "none,int8,gguf:Q4_0", "--peer-limit", "2",
                          "--peer-max-tokens", "3", "--peer-ms", "2", "--decode-steps", "2", "--min-time", "0.001", "--max-num-tokens", "32",
                          "--threads", "1", "--clock", "cpu", "--out", str(out)])  # fmt: skip
    rows = {(r["section"], r["label"]): r for r in record["rows"]}
    assert {section for section, _ in rows} == {"prefill", "decode", "8b", "peer64"}
    assert len(rows) == 1 + 2 + 3 * 2 + 1
    assert sum(fmt in label for _, label in rows for fmt in ("int8 batch", "gguf:Q4_0 batch")) == 4
    for row in rows.values():
        assert row["figure"] > 0 and row["bound"] > 0 and row["ratio"] == pytest.approx(row["bound"] / row["figure"])
    assert json.loads(out.read_text())["machine"]["cpu_family"] == record["machine"]["cpu_family"]
    assert record["clock"] == "cpu"
    printed = capsys.readouterr().out
    assert "family" in printed and "bound ms" in printed


def test_a_row_over_the_memory_budget_is_skipped_with_its_size(limits, tiny_model, tmp_path):
    record = limits.main(["--model", str(tiny_model), "--sections", "decode", "--contexts", "64,4000000",
                          "--batches", "1", "--decode-steps", "1", "--memory-gib", "1", "--threads", "1",
                          "--out", str(tmp_path / "l.json")])  # fmt: skip
    fitted, skipped = record["rows"]
    assert fitted["figure"] > 0
    assert skipped["figure"] is None and "skipped: needs" in skipped["note"] and "--memory-gib 1" in skipped["note"]


def test_a_context_longer_than_the_model_s_is_refused_by_name(limits, tiny_model, tmp_path):
    record = limits.main(["--model", str(tiny_model), "--sections", "prefill,decode", "--contexts", "9000",
                          "--batches", "1", "--threads", "1", "--min-time", "0.001", "--max-num-tokens", "32",
                          "--out", str(tmp_path / "l.json")])  # fmt: skip
    assert [r["note"] for r in record["rows"]] == ["refused: the model's context is 8192 tokens"] * 2


def test_cpu_time_needs_one_thread(limits):
    with pytest.raises(SystemExit, match="--threads 1"):
        limits.main(["--clock", "cpu", "--threads", "2"])


def test_shared_context_prompts_differ_only_in_their_last_tokens(limits, tiny_model, tmp_path):
    args = limits.parse_args(["--shared-context"])
    prompts = limits.decode_prompts(args, 512, 96, 3)
    assert [len(p) for p in prompts] == [96] * 3
    assert prompts[0][:80] == prompts[1][:80] == prompts[2][:80]
    assert len({tuple(p[80:]) for p in prompts}) == 3
    record = limits.main(["--model", str(tiny_model), "--sections", "decode", "--contexts", "96", "--batches", "3",
                          "--shared-context", "--decode-steps", "2", "--threads", "1", "--clock", "cpu",
                          "--out", str(tmp_path / "l.json")])  # fmt: skip
    (row,) = record["rows"]
    assert row["figure"] > 0 and row["bound"] > 0


def test_the_default_model_s_context_is_raised_for_longer_contexts(limits, tmp_path):
    folder = limits.default_model_with_positions(40000, tmp_path / "long")
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == 40000 and config["num_hidden_layers"] == 30
    weights = folder / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().parent.name.startswith("SmolLM2-135M-Instruct")


def test_a_preset_model_is_written_with_the_layers_asked_for(limits, tmp_path):
    record = limits.main(["--model", "preset:tiny-llama", "--layers", "1", "--sections", "decode", "--contexts", "64",
                          "--batches", "1", "--decode-steps", "1", "--threads", "1", "--clock", "cpu",
                          "--out", str(tmp_path / "l.json")])  # fmt: skip
    (row,) = record["rows"]
    assert row["label"].startswith("tiny Llama (1 of 2 layers) decode batch 1") and row["figure"] > 0
