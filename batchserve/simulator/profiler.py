"""`batchserve profile`: time real engine steps over a grid of shapes on this machine, fit the step-time model
(step_model.LinearStepModel: linear in the step's shape, piecewise linear in its tokens), save it as a profile for
`batchserve simulate`.

  batchserve profile --output prof.json                  # the default model, dtype and threads, ~1-2 minutes
  batchserve profile --output prof.json --num-threads 2 --dtype float32 --max-batch-size 32
  batchserve profile --refit prof.json --output new.json # fit the steps prof.json recorded again (--knots K,K,...)
  batchserve profile --refit prof.json --with-run run.json --output new.json   # and a real run's steps

The grid: for each (sequences, prompt length) a batch is prefilled (chunks up to max_num_tokens) and decodes 16
tokens, which times prefill chunks of many sizes and decodes of every batch size at short and long contexts; then
a staggered group, where new prompts join running decodes, times mixed steps. Each step is timed whole (schedule,
forward, sample, update, detokenize), as bench's driver sees it. The fit's error is measured on held-out steps
(5-fold), overall, by step kind and for decodes by batch size.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchserve.entrypoints.engine_args import ArgumentParser, add_engine_arguments, engine_config_from_args
from batchserve.simulator.profile_file import Profile
from batchserve.simulator.shape import StepShape, shape_of
from batchserve.simulator.step_model import KNOTS, fit_linear

# (sequences, prompt tokens): decodes of 1-64 sequences at contexts up to ~16 k positions a step (1-4 sequences at short
# and long contexts: there the time per token bends; 8 x 2,048 and 16 x 1,024: a batch of long documents, whose decodes
# cost more per position than the short contexts extrapolate), prefill chunks of every size up to the token budget;
# ~72 k prompt tokens in all, 1.5-2 minutes on 2 cores for SmolLM2-135M
GRID = [(1, 32), (1, 256), (1, 1536), (2, 128), (2, 1024), (3, 512), (4, 64), (4, 1024), (8, 32), (8, 512), (16, 128),
        (16, 512), (32, 32), (32, 256), (48, 64), (64, 32), (8, 2048), (16, 1024)]  # fmt: skip
DECODE_TOKENS = 16
# (sequences, shared prefix tokens): decodes that read the same prefix blocks
SHARED_GRID = [(8, 1024), (16, 512), (32, 512), (48, 256)]
MAX_PREFILL_TOKENS = 16384  # per group: keeps the whole grid within a couple of minutes on a small CPU


class ShapeRecorder:
    """Wraps the engine's runner: notes the shape of every step it executes."""

    def __init__(self, engine: Any) -> None:
        self.inner, self.engine = engine.runner, engine
        self.num_kv_blocks, self.num_swap_blocks = self.inner.num_kv_blocks, self.inner.num_swap_blocks
        self.last_shape = StepShape()

    def __getattr__(self, name: str) -> Any:  # device, dtype, last_timings: the real runner's
        return getattr(self.inner, name)

    def execute(self, out: Any) -> Any:
        self.last_shape = shape_of(out, self.engine.scheduler)
        return self.inner.execute(out)


@dataclass
class Timings:
    shapes: list[StepShape] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    clock: Callable[[], float] = time.perf_counter  # or the thread's CPU time (profile --cpu-clock)

    def step(self, engine: Any, recorder: ShapeRecorder, keep: bool = True) -> None:
        start = self.clock()
        engine.step()
        elapsed = self.clock() - start
        if keep and recorder.last_shape.seqs:
            self.shapes.append(recorder.last_shape)
            self.seconds.append(elapsed)


def _add(engine: Any, rng: random.Random, n: int, prompt_len: int, max_tokens: int, tag: str) -> None:
    from batchserve.sampling_params import SamplingParams

    vocab = engine.limits.vocab_size
    for i in range(n):
        ids = [rng.randrange(100, vocab) for _ in range(prompt_len)]  # random ids: no prefix hits between requests
        engine.add_prompt(f"{tag}-{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


def run_grid(engine: Any, grid: list[tuple[int, int]], seed: int = 0, progress: bool = True,
             mixed: bool = True, clock: Callable[[], float] = time.perf_counter) -> Timings:  # fmt: skip
    """Time every step of the grid's groups (and with `mixed`, of prompts joining decodes and of decodes behind a
    shared prefix), after an untimed warm-up."""
    recorder = ShapeRecorder(engine) if not isinstance(engine.runner, ShapeRecorder) else engine.runner
    engine.runner = recorder
    rng, t = random.Random(seed), Timings(clock=clock)
    mbs = engine.config.scheduler.max_batch_size
    limit = engine.limits.max_input_len
    # the first steps pay one-time costs (packing, allocation), and the first seconds of a new process run slower
    # than the rest on some hosts (a first group timed 20% slow once repeated): one short group untimed
    _add(engine, rng, min(4, mbs), 64, DECODE_TOKENS, "warmup")
    while engine.has_unfinished_requests():
        t.step(engine, recorder, keep=False)
    for g, (seqs, prompt_len) in enumerate(grid):
        seqs, prompt_len = min(seqs, mbs), min(prompt_len, limit - DECODE_TOKENS)
        if seqs * prompt_len > MAX_PREFILL_TOKENS:
            continue
        started = time.perf_counter()
        _add(engine, rng, seqs, prompt_len, DECODE_TOKENS, f"g{g}")
        while engine.has_unfinished_requests():
            t.step(engine, recorder)
        if progress:
            print(f"  {seqs:>3} x {prompt_len:>5} tokens: {time.perf_counter() - started:6.2f} s", file=sys.stderr)
    if not mixed:
        return t
    for running in (2, 16):
        _time_joins(engine, rng, t, recorder, min(running, mbs), limit)
    if engine.config.cache.enable_prefix_caching:
        for seqs, prefix_len in SHARED_GRID:
            _time_shared_decodes(engine, rng, t, recorder, min(seqs, mbs), min(prefix_len, limit - 64))
    return t


def _time_shared_decodes(engine: Any, rng: random.Random, t: Timings, recorder: ShapeRecorder, seqs: int,
                         prefix_len: int) -> None:  # fmt: skip
    """Decodes behind one cached prefix (a shared system prompt): their attention reads the prefix's blocks once from
    memory and then from cache, which the fit needs to tell from decodes that each read blocks of their own."""
    from batchserve.sampling_params import SamplingParams

    vocab = engine.limits.vocab_size
    prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=0.0)
    engine.add_prompt(f"shared-{seqs}-{prefix_len}-first", prefix, params)
    while engine.has_unfinished_requests():  # the prefix is computed and cached before the others arrive
        t.step(engine, recorder)
    for i in range(seqs):
        ids = prefix + [rng.randrange(100, vocab) for _ in range(16)]
        engine.add_prompt(f"shared-{seqs}-{prefix_len}-{i}", ids, params)
    while engine.has_unfinished_requests():
        t.step(engine, recorder)


def _time_joins(engine: Any, rng: random.Random, t: Timings, recorder: ShapeRecorder, running: int, limit: int) -> None:
    """Mixed steps as arrivals make them: prompts of 32-512 tokens joining `running` decodes, every other one behind
    a 256-token prefix already in the cache (a chunk over cached context, as a shared system prompt makes it)."""
    from batchserve.sampling_params import SamplingParams

    _add(engine, rng, running, 64, 48, f"joins-{running}-decode")
    vocab = engine.limits.vocab_size
    prefix = [rng.randrange(100, vocab) for _ in range(256)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for k in range(12):
        length = min(32 * 2 ** (k % 5), limit - 4 - len(prefix))
        ids = [rng.randrange(100, vocab) for _ in range(length)]
        engine.add_prompt(f"joins-{running}-{k}", prefix + ids if k % 2 else ids, params)
        for _ in range(3):
            t.step(engine, recorder)
    while engine.has_unfinished_requests():
        t.step(engine, recorder)


# The speed check's groups: decodes of 1 and 8 sequences and their prompts, a few seconds on a small CPU
CHECK_GRID = [(1, 64), (8, 64), (1, 64)]


@dataclass
class SpeedCheck:
    """How many times as long as a profile predicts this host's steps take now (measured / predicted), for decode-only
    steps and for the others (prefill chunks, alone or with decodes), and the steps it timed."""

    factor: float
    decode_factor: float
    timings: Timings

    def simulate_flags(self) -> str:
        return f"--time-scale {self.factor:.3f} --decode-time-scale {self.decode_factor:.3f}"


def check_speed(
    engine: Any, profile: Profile, seed: int = 0, clock: Callable[[], float] = time.perf_counter
) -> SpeedCheck:
    """Time the check's groups on `engine` and compare with `profile`: a profile taken on a host that has since slowed
    down or sped up predicts by these factors off. `clock`: the profile's (time.thread_time for a CPU-clock one)."""
    t = run_grid(engine, CHECK_GRID, seed, progress=False, mixed=False, clock=clock)

    def ratio(decode: bool) -> float:
        steps = [(s, sec) for s, sec in zip(t.shapes, t.seconds, strict=True) if (s.kind == "decode") == decode]
        return sum(sec for _, sec in steps) / sum(profile.step_model.predict(s) for s, _ in steps)

    return SpeedCheck(ratio(False), ratio(True), t)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="batchserve profile", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--output", default="step_profile.json", help="where the profile goes (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no line per grid point")
    p.add_argument("--refit", metavar="PROFILE", help="refit the steps a profile recorded (no model is loaded)")
    p.add_argument("--with-run", action="append", default=[], metavar="RUN.json",
                   help="--refit: add the steps a real run recorded (benchmarks/slo_mix.py --engine --json) to the "
                        "fit, on the run's clock (repeatable)")  # fmt: skip
    p.add_argument("--check", metavar="PROFILE",
                   help="time a few steps now and say how far this host's speed is from the profile's (the factors "
                        "for simulate --time-scale and --decode-time-scale); engine flags as for the profile")  # fmt: skip
    p.add_argument("--cpu-clock", action="store_true",
                   help="time the steps on the engine thread's CPU time, not the wall clock (with --num-threads 1): "
                        "on a busy host, the profile a quiet one would give, less cache sharing")  # fmt: skip
    p.add_argument("--knots", type=parse_knots, default=",".join(map(str, KNOTS)), metavar="K,K,...",
                   help="token counts where the time per token may change (default: %(default)s; '' for the plain "
                        "linear model)")  # fmt: skip
    add_engine_arguments(p)
    return p


def parse_knots(text: str) -> tuple[int, ...]:
    return tuple(int(k) for k in text.split(",") if k.strip())


def refit(path: str, output: str, knots: tuple[int, ...] = KNOTS, runs: tuple[str, ...] = ()) -> Profile:
    """The profile at `path` with its step model fitted again from the steps it recorded, and with `runs` from the
    steps real runs recorded too (run_steps)."""
    profile = Profile.load(path)
    fields, rows = profile.notes.get("step_fields"), profile.notes.get("steps")
    if not rows:
        raise ValueError(f"{path} recorded no steps")
    shapes = [StepShape(**dict(zip(fields[:-1], r[:-1], strict=True))) for r in rows]
    if "decode_ctx_distinct" not in fields:  # recorded before it was: counted as read from memory, every position
        for s in shapes:
            s.decode_ctx_distinct = s.decode_ctx
    seconds = [r[-1] for r in rows]
    for run in runs:
        more, times = run_steps(run)
        shapes, seconds = shapes + more, seconds + times
    profile.step_model, fit = fit_linear(shapes, seconds, knots)
    profile.fit = fit.to_dict()
    if runs:
        profile.notes["refit_with_runs"] = [Path(r).name for r in runs]
    profile.save(output)
    return profile


def run_steps(path: str) -> tuple[list[StepShape], list[float]]:
    """The steps a real run recorded (benchmarks/slo_mix.py --engine --json: per policy, each step's shape and its
    wall and thread CPU times), timed on the run's clock: the shapes a workload really runs, which a grid may not
    reach (decodes over tens of thousands of K/V positions, prefill chunks beside them)."""
    data = json.loads(Path(path).read_text())
    key = "cpu_s" if data.get("cpu_clock") else "wall_s"
    names = set(StepShape().to_dict())
    steps = [step for run in data.get("steps", {}).values() for step in run if isinstance(step, dict)]
    if not steps:
        raise ValueError(f"{path} recorded no steps with their shapes (slo_mix.py --engine --json)")
    return [StepShape(**{k: v for k, v in s.items() if k in names}) for s in steps], [s[key] for s in steps]


def report(profile: Profile, path: Any) -> None:
    model, fit = profile.step_model, profile.fit
    c = model.coefficients
    (_, first), *past = model.token_slopes()
    pieces = f" ({', '.join(f'{1e6 * slope:.2f} past {k}' for k, slope in past)})" if past else ""
    print(f"step time = {1e3 * c['steps']:.3f} ms + {1e6 * first:.2f} us/token{pieces} + {1e6 * c['seqs']:.2f} us/seq "
          f"+ {1e6 * c['samples']:.2f} us/sampled row + {1e9 * c['decode_ctx']:.2f} ns/decode K/V position "
          f"+ {1e9 * c.get('decode_ctx_distinct', 0.0):.2f} ns/decode K/V position no other decode read "
          f"+ {1e12 * c['prefill_pairs']:.2f} ps/prefill query-key pair "
          f"+ {1e6 * c.get('prefill_seqs', 0.0):.2f} us/prefill chunk + {1e6 * c.get('mixed', 0.0):.2f} us/mixed step "
          f"+ {1e6 * c.get('multi_row', 0.0):.2f} us/step of more than one row")  # fmt: skip
    print(f"fit on {fit['num_steps']} steps; held-out error (5-fold): mean {100 * fit['mape']:.1f}%, p90 "
          f"{100 * fit['p90_ape']:.1f}%, sum {100 * fit['total_error']:+.1f}%, R^2 {fit['r2']:.3f}; wrote {path}")  # fmt: skip
    groups = {**fit["by_kind"], **{f"decode of {k} seqs": e for k, e in fit.get("decode_by_seqs", {}).items()}}
    for kind, e in groups.items():
        print(f"  {kind:<19} {e['steps']:>4} steps: mean error {100 * e['mape']:.1f}%, bias {100 * e['bias']:+.1f}%")


def main(argv: list[str] | None = None) -> int:
    from batchserve.bench.machine import describe, machine_info
    from batchserve.engine.llm_engine import LLMEngine
    from batchserve.host.memory import available_memory_bytes, block_bytes
    from batchserve.host.process import configure_torch

    args = build_parser().parse_args(argv)
    if args.refit:
        report(refit(args.refit, args.output, args.knots, tuple(args.with_run)), args.output)
        return 0
    try:
        config = engine_config_from_args(args)
        if args.cpu_clock and config.num_threads != 1:
            raise ValueError("--cpu-clock needs --num-threads 1 (every step's work on the engine's own thread)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_torch(config.num_threads, config.seed)
    engine = LLMEngine(config)
    if args.check:
        clock = time.thread_time if args.cpu_clock else time.perf_counter
        check = check_speed(engine, Profile.load(args.check), config.seed, clock)
        print(f"steps with a prompt take {check.factor:.3f}x, decode steps {check.decode_factor:.3f}x the time "
              f"{args.check} predicts ({len(check.timings.seconds)} steps, {sum(check.timings.seconds):.2f} s): "
              f"simulate {check.simulate_flags()}")  # fmt: skip
        return 0
    runner, dtype = engine.runner, str(engine.runner.dtype).removeprefix("torch.")
    import torch

    info = machine_info(torch.get_num_threads(), dtype)
    print(f"profiling on {describe(info)}", file=sys.stderr)
    wall = time.perf_counter()
    clock = time.thread_time if args.cpu_clock else time.perf_counter
    timings = run_grid(engine, GRID, config.seed, not args.no_progress, clock=clock)
    model, fit = fit_linear(timings.shapes, timings.seconds, args.knots)
    per_token = block_bytes(engine.model_config, 1, runner.dtype)
    pool = runner.num_kv_blocks * config.cache.block_size * per_token
    free = available_memory_bytes(runner.device) + pool if config.cache.num_kv_blocks is None else 0
    profile = Profile(
        source="measured", step_model=model, model=str(config.model or "SmolLM2-135M-Instruct"), dtype=dtype,
        kv_bytes_per_token=per_token, kv_cache_bytes=pool, max_model_len=engine.model_config.max_position_embeddings,
        memory_free_bytes=free, machine=info, fit=fit.to_dict(),
        notes={"grid": GRID, "decode_tokens": DECODE_TOKENS, "seconds": time.perf_counter() - wall,
               # every timed step, to refit another model without measuring again
               "step_fields": [*StepShape().to_dict(), "seconds"],
               "steps": [[*s.to_dict().values(), round(t, 7)] for s, t in zip(timings.shapes, timings.seconds, strict=True)],
               "engine": {k: str(v) for k, v in engine.effective_config().items()},
               "clock": "thread CPU time" if args.cpu_clock else "wall"},
    )  # fmt: skip
    path = profile.save(args.output)
    report(profile, path)
    print(f"profiled in {time.perf_counter() - wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
