"""The simulator's price of LoRA adapters: rows of requests with an adapter, counted from the real scheduler's
decisions, cost more by the adapter's FLOPs; each distinct adapter in a step costs its bytes once."""

from __future__ import annotations

import pytest

from batchserve.config import EngineConfig
from batchserve.sampling_params import SamplingParams
from batchserve.simulator.analytic import MODEL_SHAPES, resolve_device, roofline_model
from batchserve.simulator.engine import SimEngine
from batchserve.simulator.lora_cost import LoRAShape, base_projection_params, lora_step_model
from batchserve.simulator.shape import StepShape
from batchserve.simulator.step_model import ScaledStepModel
from tests.simulator.helpers import STEP_MODEL

SMOL = MODEL_SHAPES["smollm2-135m"]


def test_a_steps_adapter_rows_and_groups_come_from_the_scheduler():
    engine = SimEngine(EngineConfig.from_options(block_size=8), STEP_MODEL, 64, 1024)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("base", list(range(10)), params)
    engine.add_request("sql-1", list(range(20, 26)), params, lora_id=1)
    engine.add_request("sql-2", list(range(30, 33)), params, lora_id=1)
    engine.add_request("chat", list(range(40, 47)), params, lora_id=2)
    engine.step()
    shape = engine.runner.last_shape
    assert (shape.tokens, shape.lora_tokens, shape.lora_groups) == (10 + 6 + 3 + 7, 6 + 3 + 7, 2)
    engine.step()
    assert (engine.runner.last_shape.lora_tokens, engine.runner.last_shape.lora_groups) == (3, 2)  # decodes


def test_adapter_cost_grows_with_rank_targets_rows_and_groups():
    model = lora_step_model(STEP_MODEL, SMOL, LoRAShape(rank=16))
    plain = StepShape(tokens=64, seqs=8, samples=8, decode_ctx=4000)
    with_rows = StepShape(**{**plain.to_dict(), "lora_tokens": 32, "lora_groups": 1})
    two_groups = StepShape(**{**with_rows.to_dict(), "lora_groups": 2})
    assert model.predict(plain) == STEP_MODEL.predict(plain)
    assert model.predict(plain) < model.predict(with_rows) < model.predict(two_groups)
    extra = model.predict(with_rows) - STEP_MODEL.predict(plain)
    rank32 = lora_step_model(STEP_MODEL, SMOL, LoRAShape(rank=32))
    assert rank32.predict(with_rows) - STEP_MODEL.predict(plain) == pytest.approx(2 * extra)
    attention_only = lora_step_model(STEP_MODEL, SMOL, LoRAShape(16, ("q_proj", "k_proj", "v_proj", "o_proj")))
    assert attention_only.predict(with_rows) - STEP_MODEL.predict(plain) < extra / 2  # the MLP is most of it
    # rank 16 on all seven projections adds about 16 * (in + out) / (in * out) of the base projections' FLOPs
    share = LoRAShape(16).params(SMOL) / base_projection_params(SMOL)
    assert 0.03 < share < 0.1
    assert model.seconds_per_token == pytest.approx(share * STEP_MODEL.coefficients["tokens"])


def test_a_roofline_prices_adapters_at_its_rates_and_a_scaled_profile_scales_them():
    device = resolve_device("l4")
    roofline = roofline_model(SMOL, device, "bfloat16")
    model = lora_step_model(roofline, SMOL, LoRAShape(rank=8))
    params = LoRAShape(rank=8).params(SMOL)
    assert model.seconds_per_token == pytest.approx(2 * params / roofline.peak_flops)
    assert model.seconds_per_adapter == pytest.approx(2 * params / roofline.bandwidth)
    slow = lora_step_model(ScaledStepModel(roofline, 3.0), SMOL, LoRAShape(rank=8))
    assert slow.seconds_per_token == pytest.approx(3 * model.seconds_per_token)


def test_bad_adapter_shapes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="rank"):
        LoRAShape(rank=0)
    with pytest.raises(ValueError, match="targets"):
        LoRAShape(rank=8, targets=("lm_head",))


def test_the_simulated_scheduler_holds_max_loras_a_step_and_adapters_cost_time():
    """Requests spread over 4 adapters with max_loras 2: no step runs more than 2; the run takes longer with the
    adapters' cost than without."""
    from batchserve.simulator.build import make_cluster
    from batchserve.simulator.profile_file import Profile
    from tests.simulator.test_tune_kv_tier import system_prompt_requests

    config = EngineConfig.from_options(block_size=16, enable_lora=True, max_loras=2, num_kv_blocks=256)
    requests = system_prompt_requests(prompts=4, rounds=3)
    engine = SimEngine(config, lora_step_model(STEP_MODEL, SMOL, LoRAShape(16)), 256, 1024)
    for i, r in enumerate(requests):
        engine.add_request(r.request_id, r.prompt_token_ids, SamplingParams(max_tokens=4, ignore_eos=True),
                           lora_id=i % 4 + 1)  # fmt: skip
    groups = []
    while engine.has_unfinished_requests():
        engine.step()
        groups.append(engine.runner.last_shape.lora_groups)
    assert max(groups) == 2
    durations = {}
    for rank in (0, 64):
        step_model = lora_step_model(STEP_MODEL, SMOL, LoRAShape(rank)) if rank else STEP_MODEL
        profile = Profile("measured", step_model, "tiny", "float32", 1024, 1024 * 16 * 512, 4096)
        result = make_cluster(config, profile, lora_adapters=4 if rank else 0).run(requests)
        durations[rank] = result.trace.meta["duration_s"]
    assert durations[64] > durations[0]


def test_simulate_flags_price_adapters_and_refuse_bad_ones():
    from batchserve.entrypoints.engine_args import engine_config_from_args
    from batchserve.simulator.cli import build_parser, load_profile
    from batchserve.simulator.lora_cost import LoRAStepModel

    def profile_of(*flags):
        args = build_parser().parse_args(["--device-preset", "l4", *flags])
        return load_profile(args, engine_config_from_args(args))

    assert isinstance(profile_of("--enable-lora", "--lora-rank", "16").step_model, LoRAStepModel)
    assert not isinstance(profile_of().step_model, LoRAStepModel)
    for flags, named in ((["--lora-rank", "16"], "--enable-lora"),
                         (["--enable-lora", "--lora-rank", "64"], "--max-lora-rank"),
                         (["--enable-lora", "--lora-rank", "8", "--lora-targets", "lm_head"], "--lora-targets")):  # fmt: skip
        with pytest.raises(ValueError, match=named):
            profile_of(*flags)
