"""The parallel step model (a TP x PP step from a single-rank model and the collectives' cost), each rank's memory,
and `simulate --find-layout`'s sweep, against numbers worked out by hand."""

from __future__ import annotations

import json

import pytest

from batchserve.config import EngineConfig
from batchserve.simulator.analytic import Device, Shapes, kv_bytes_per_token, roofline_model
from batchserve.simulator.layouts import Target, candidate_layouts, find_layout
from batchserve.simulator.parallel import (
    Collective,
    Layout,
    ParallelStepModel,
    parallel_profile,
    rank_memory,
    serial_seconds,
)
from batchserve.simulator.profile_file import Profile
from batchserve.simulator.shape import StepShape
from batchserve.simulator.step_model import LinearStepModel, ScaledStepModel
from batchserve.simulator.trace_file import load_trace
from tests.simulator.helpers import STEP_MODEL

# 4 layers, hidden 32, MLP 64, 4 query heads and 2 KV heads of 8, vocabulary 100, untied
SHAPES = Shapes(name="tiny-tp", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip
DECODE = StepShape(tokens=8, seqs=8, samples=8, decode_ctx=400)
PREFILL = StepShape(tokens=96, seqs=2, samples=2, prefill_pairs=3000, prefill_ctx=96, prefill_seqs=2)
MIXED = StepShape(tokens=40, seqs=5, samples=5, decode_ctx=200, prefill_pairs=900, prefill_ctx=36, prefill_seqs=1)
ROOFLINE = roofline_model(SHAPES, Device("toy", 1e9, 1e8, 1e9, overhead_s=2e-3, overhead_per_seq_s=1e-4), "float32")
LINK = Collective(bandwidth=1e8, latency_s=20e-6)


@pytest.mark.parametrize("inner", [STEP_MODEL, ROOFLINE, ScaledStepModel(STEP_MODEL, 1.3, 0.8)])
@pytest.mark.parametrize("shape", [DECODE, PREFILL, MIXED, StepShape()])
def test_one_rank_is_the_single_rank_model(inner, shape):
    model = ParallelStepModel(inner, SHAPES, "float32", 1, 1, LINK)
    assert model.predict(shape) == pytest.approx(inner.predict(shape), rel=1e-12)
    assert model.collective_seconds(shape) == model.handover_seconds(shape) == 0.0


def test_tensor_parallel_step_by_hand():
    model = ParallelStepModel(STEP_MODEL, SHAPES, "float32", 2, 1, LINK)
    whole, serial = STEP_MODEL.predict(DECODE), 2e-3 + 5e-5 * 8  # the fixed and per-sequence terms stay whole
    assert serial_seconds(STEP_MODEL, DECODE) == pytest.approx(serial)
    activation = 8 * 32 * 4  # [tokens, hidden] float32
    all_reduce = 2 * (2 - 1) * (activation / 2 / 1e8 + 20e-6)  # a ring: 2(N-1) phases of 1/N of the tensor
    gather = (2 - 1) * (8 * 100 * 4 / 2 / 1e8 + 20e-6)  # the logits of 8 rows
    comm = (2 * 4 + 1) * all_reduce + gather  # two a layer and one after the embedding
    assert model.collective_seconds(DECODE) == pytest.approx(comm)
    assert model.predict(DECODE) == pytest.approx(serial + (whole - serial) / 2 + comm)


def test_the_collectives_share_grows_with_the_ranks_as_the_model_says():
    shares, comms = [], []
    for n in (1, 2, 4):  # 4 ranks: the 2 KV heads replicated
        model = ParallelStepModel(ROOFLINE, SHAPES, "float32", n, 1, LINK)
        comm = model.collective_seconds(DECODE)
        expected = (
            0.0
            if n == 1
            else 9 * 2 * (n - 1) * (8 * 32 * 4 / n / 1e8 + 20e-6) + (n - 1) * (8 * 100 * 4 / n / 1e8 + 20e-6)
        )
        assert comm == pytest.approx(expected)
        assert model.collective_share(DECODE) == pytest.approx(comm / model.seconds(DECODE)[0])
        comms.append(comm)
        model.predict(DECODE)
        model.predict(PREFILL)
        run = (model.collective_seconds(DECODE) + model.collective_seconds(PREFILL)) / (
            model.seconds(DECODE)[0] + model.seconds(PREFILL)[0]
        )
        assert model.spent_share == pytest.approx(run)  # a run's share: its steps' collectives over its steps
        shares.append(model.collective_share(DECODE))
    assert shares[0] == 0.0 and shares[0] < shares[1] < shares[2]
    assert comms[1] < comms[2]


def test_pipeline_stages_add_hand_overs_not_throughput():
    one = ParallelStepModel(STEP_MODEL, SHAPES, "float32", 1, 1, LINK)
    two = ParallelStepModel(STEP_MODEL, SHAPES, "float32", 1, 2, LINK)
    handover = LINK.send_s(2 * 96 * 32 * 4) + LINK.send_s(8 * 2)  # hidden + residual to stage 2; tokens back
    assert two.handover_seconds(PREFILL) == pytest.approx(handover)
    # no micro-batches: the stages run one after the other, so the step is the whole model's plus the hand-overs
    assert two.predict(PREFILL) == pytest.approx(one.predict(PREFILL) + handover)


def test_a_split_the_engine_refuses_is_refused_naming_both_numbers():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's num_attention_heads 4"):
        ParallelStepModel(STEP_MODEL, SHAPES, "float32", 3, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 is more than the model's num_hidden_layers 4"):
        ParallelStepModel(STEP_MODEL, SHAPES, "float32", 1, 5)


def test_each_ranks_weights_and_kv_heads():
    whole = (4 * SHAPES.layer_params + 2 * SHAPES.head_params) * 4
    kv = kv_bytes_per_token(SHAPES, "float32")
    one, two = rank_memory(SHAPES, "float32", 1, 1, 1e6), rank_memory(SHAPES, "float32", 2, 1, 1e6)
    assert one.weight_bytes == whole and two.weight_bytes == whole // 2
    assert one.kv_bytes_per_token == kv and two.kv_bytes_per_token == kv // 2  # a rank keeps its heads only
    assert rank_memory(SHAPES, "float32", 4, 1, 1e6).kv_bytes_per_token == kv // 2  # 2 KV heads replicated over 4
    stage = rank_memory(SHAPES, "float32", 1, 2, 1e6)  # 2 of the 4 layers and one vocabulary table
    assert stage.weight_bytes == (2 * SHAPES.layer_params + SHAPES.head_params) * 4
    assert stage.kv_bytes_per_token == kv // 2
    # the pool's bytes stay, its bytes a token halve: the pool holds twice the tokens
    profile = measured_profile(free=4 << 20)
    assert parallel_profile(profile, SHAPES, 2, 1).num_kv_blocks(16) > 1.9 * parallel_profile(
        profile, SHAPES, 1, 1
    ).num_kv_blocks(16)


def test_weights_over_the_memory_cap_do_not_fit():
    whole = SHAPES.total_params * 4
    with pytest.raises(ValueError, match="a rank's weights .* do not fit its memory"):
        parallel_profile(measured_profile(), SHAPES, 1, 1, rank_memory_bytes=0.9 * whole)
    assert parallel_profile(measured_profile(), SHAPES, 2, 1, rank_memory_bytes=0.9 * whole).kv_cache_bytes > 0


def measured_profile(model=None, free: int = 4 << 20) -> Profile:
    return Profile("measured", model or STEP_MODEL, "tiny-tp", "float32", kv_bytes_per_token(SHAPES, "float32"),
                   free // 4, 256, memory_free_bytes=free)  # fmt: skip


def burst(tmp_path, n: int = 16, prompt: int = 4, output: int = 16):
    """n requests arriving at once: what a layout delivers is its capacity."""
    path = tmp_path / "burst.jsonl"
    path.write_text("".join(json.dumps({"arrival_s": 0.0, "input_len": prompt, "output_len": output}) + "\n"
                            for _ in range(n)))  # fmt: skip
    return load_trace(path)


def test_candidates_go_from_the_fewest_hosts_up():
    layouts = candidate_layouts(SHAPES, 4)
    assert layouts[0] == Layout(1, 1, 1)
    hosts = [x.hosts() for x in layouts]
    assert hosts == sorted(hosts) and max(hosts) == 4
    assert Layout(3, 1, 1) not in layouts  # 3 does not divide the 4 heads
    # two ranks a host: two replicas of one rank, or one split in two, fill one host
    assert candidate_layouts(SHAPES, 2, ranks_per_host=2)[:4] == [Layout(1, 1, 1), Layout(1, 1, 2), Layout(2, 1, 1),
                                                                  Layout(1, 2, 1)]  # fmt: skip


def test_sweep_takes_the_first_layout_whose_weights_fit(tmp_path):
    requests, arrivals = burst(tmp_path)
    config = EngineConfig.from_options(max_batch_size=16, block_size=16, kv_cache_memory_fraction=0.9)
    cap = 0.8 * SHAPES.total_params * 4  # the whole model does not fit a host, half of it does
    rows = find_layout(config, measured_profile(), SHAPES, requests, arrivals, Target(output_throughput=1.0), 4, cap)
    assert [r.layout for r in rows] == [Layout(1, 1, 1), Layout(1, 1, 2), Layout(2, 1, 1)]
    assert all(r.verdict.startswith("does not fit") for r in rows[:2])
    assert rows[-1].meets and rows[-1].hosts == 2
    assert 0 < rows[-1].collective_share < 1  # two ranks all-reduce; the layouts that did not fit never ran


def test_sweep_takes_the_smallest_layout_that_reaches_the_throughput(tmp_path):
    # 10 ms a token, all of it split over ranks: one replica runs 100 tokens/s; a request's are its 4 prompt tokens
    # and 15 decodes (the prefill samples the first of its 16 output tokens), so 100 x 16/19 output tokens/s
    model = LinearStepModel({"tokens": 1e-2})
    requests, arrivals = burst(tmp_path)
    config = EngineConfig.from_options(max_batch_size=16, block_size=16)
    fast = Collective(bandwidth=1e15, latency_s=0.0)
    rows = find_layout(config, measured_profile(model), SHAPES, requests, arrivals, Target(output_throughput=150.0), 8,
                       collective=fast)  # fmt: skip
    assert rows[0].layout == Layout(1, 1, 1) and rows[0].summary["output_throughput"] == pytest.approx(100 * 16 / 19)
    assert rows[0].verdict.startswith("misses")
    best = rows[-1]
    assert best.meets and best.hosts == 2 and best.layout == Layout(1, 1, 2)  # two replicas before TP=2 at 2 hosts
    assert best.summary["output_throughput"] == pytest.approx(200 * 16 / 19)
    assert best.collective_share == 0.0  # replicas, no split


def test_sweep_needs_a_target():
    with pytest.raises(ValueError, match="--target-throughput"):
        Target()


def test_simulate_runs_a_split_and_refuses_one_the_model_cannot_take(tmp_path, capsys):
    from batchserve.simulator.cli import main

    measured_profile().save(tmp_path / "p.json")
    burst(tmp_path)
    base = ["--profile", str(tmp_path / "p.json"), "--trace", str(tmp_path / "burst.jsonl"), "--num-requests", "16",
            "--no-save-result", "--no-plots", "--model-shapes", "smollm2-135m"]  # fmt: skip
    assert main([*base, "--tensor-parallel-size", "2"]) == 2
    assert "tensor_parallel_size 2 does not divide the model's num_attention_heads 9" in capsys.readouterr().err
    assert main([*base, "--tensor-parallel-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "TP=3 x PP=1" in out and "collectives and stage hand-overs:" in out
    argv = [*base, "--find-layout", "--target-throughput", "1", "--max-hosts", "3", "--host-memory-gib", "0.2"]
    assert main(argv) == 0  # SmolLM2-135M in float32 (0.5 GiB) needs 3 ranks of 0.2 GiB
    assert "smallest layout: TP=3 x PP=1 x 1 replica(s) on 3 host(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tensor-parallel-size", "3", "--allreduce-bandwidth-gbs", "0"], "--allreduce-bandwidth-gbs must be > 0"),
        (["--tensor-parallel-size", "3", "--ranks-per-host", "0"], "--ranks-per-host must be >= 1"),
        (["--host-memory-gib", "0"], "--host-memory-gib must be > 0"),
        (["--find-layout"], "needs a target: --target-throughput"),
        (["--find-layout", "--target-slo-attainment", "0.9"], "--target-slo-attainment takes a share"),
        (["--find-layout", "--target-throughput", "1", "--max-hosts", "0"], "--max-hosts and --ranks-per-host"),
    ],
)
def test_bad_parallel_flags_are_refused_naming_the_flag(tmp_path, capsys, flags, message):
    from batchserve.simulator.cli import main

    measured_profile().save(tmp_path / "p.json")
    burst(tmp_path)
    base = ["--profile", str(tmp_path / "p.json"), "--trace", str(tmp_path / "burst.jsonl"), "--no-save-result",
            "--no-plots", "--model-shapes", "smollm2-135m"]  # fmt: skip
    assert main([*base, *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_slo_target_counts_requests_within_it():
    from batchserve.bench.metrics import SLO

    target = Target(slo_attainment=0.9, slo=SLO(0.5, 0.1))
    assert target.misses({"output_throughput": 1.0, "slo_attainment": 0.95}) == []
    assert target.misses({"output_throughput": 1.0, "slo_attainment": 0.5}) == ["SLO attainment 50.0% < 90%"]
