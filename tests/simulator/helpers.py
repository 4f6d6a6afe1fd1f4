"""The real engine over the FakeRunner on a virtual clock: the reference a simulated run must equal step for step."""

from __future__ import annotations

from batchserve.bench.offline import OfflineRun, drive
from batchserve.core.outputs import RunnerTimings
from batchserve.simulator.clock import VirtualClock
from batchserve.simulator.shape import shape_of
from batchserve.simulator.step_model import LinearStepModel

# a step model with every term in play, so that timing differences show up in latencies
STEP_MODEL = LinearStepModel(
    {"steps": 2e-3, "tokens": 1e-4, "seqs": 5e-5, "samples": 2e-5, "decode_ctx": 1e-6, "prefill_pairs": 1e-8}
)


class ClockedFake:
    """Wraps the FakeRunner of tests/doubles.make_engine: the same execute(), and the virtual clock advanced by the
    step model, as the simulator's TimedRunner does."""

    def __init__(self, engine, clock: VirtualClock, model=STEP_MODEL) -> None:
        self.inner, self.engine, self.clock, self.model = engine.runner, engine, clock, model
        self.num_kv_blocks, self.num_swap_blocks = self.inner.num_kv_blocks, self.inner.num_swap_blocks
        self.last_timings = RunnerTimings()

    @property
    def steps(self):
        return self.inner.steps

    def execute(self, out):
        shape = shape_of(out, self.engine.scheduler)
        result = self.inner.execute(out)
        if not out.is_empty:  # the modelled time, as the simulator's runner reports it (the SLO fit learns it)
            seconds = self.model.predict(shape)
            self.clock.advance(seconds)
            self.last_timings = RunnerTimings(forward_s=seconds)
        return result


def run_real(engine, requests, arrivals, seed=0):
    """bench's own driver (OfflineRun) over the real engine, on a virtual clock."""
    clock = VirtualClock()
    engine.runner = ClockedFake(engine, clock)
    # deadlines, slack and the step times the SLO predictions learn on the simulated time, as in the simulator
    engine.clock = engine.scheduler.clock = clock
    return drive(OfflineRun(engine, requests, arrivals, seed, "real", False, clock, sleep=clock.sleep)), engine.runner


def decisions(out) -> tuple:
    """Everything a SchedulerOutput decides, less the token ids it carries (the fake samples letters, the simulator
    a placeholder: different tokens, same counts)."""
    return (
        list(out.num_scheduled_tokens.items()),
        [
            (n.req_id, n.num_prompt_tokens, len(n.token_ids), n.block_ids, n.num_computed_tokens)
            for n in out.new_requests
        ],
        [(c.req_id, c.new_block_ids, c.num_computed_tokens) for c in out.cached_requests],
        sorted(out.finished_req_ids),
        out.blocks_to_swap_out,
        out.blocks_to_swap_in,
        sorted(out.padding_req_ids),
    )
