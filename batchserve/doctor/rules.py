"""The findings, each a rule over an Observation, in the troubleshooting guide's terms: the symptom, the evidence in
numbers, what to change and by how much, and where the change is a knob the simulator's prediction of its effect.

The rules and what they read:
  queue_backed_up     requests wait while the batch is held by max_batch_size, max_num_tokens or the policy
  arrivals_exceed     the waiting queue grows: requests arrive faster than they finish
  kv_full             KV usage at its limit while the token budget is not (fragmentation: smaller blocks)
  long_prompts        a few very slow requests: long prompts hold the window
  preemption_thrash   requests are preempted and recomputed over and over
  goodput_falls       too few requests meet the service-level targets: the knob for the kind of miss (goodput.py)
A window where the device idles with an empty queue yields a note, not a finding: arrivals, not the engine, bound it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchserve.doctor import goodput
from batchserve.doctor.observe import Observation
from batchserve.doctor.predict import Prediction, predict, step_model_of
from batchserve.simulator.step_model import StepTimeModel

MIN_STEPS = 20  # fewer steps than this in the window: too little to judge the batch
MIN_REQUESTS = 20  # fewer finished requests: too few for a tail latency
WAITING_SHARE = 0.5  # requests waited in at least this share of the steps
BOUND_SHARE = 0.6  # a limit held the batch in at least this share of the steps with requests waiting
KV_FULL = 0.95
QUEUE_GROWTH = 1.15  # arrivals over completions
TAIL_RATIO = 3.0  # TTFT p99 over p50
LONG_PROMPT_RATIO = 4.0  # a long prompt: at least this many times the median
LONG_PROMPT_TOKEN_SHARE = 0.25
THRASH_PER_REQUEST = 0.2
FRAGMENTED = 0.15


@dataclass
class Finding:
    rule: str
    symptom: str
    evidence: list[str]
    change: str
    prediction: Prediction | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"rule": self.rule, "symptom": self.symptom, "evidence": self.evidence, "change": self.change}
        if self.prediction is not None:
            p = self.prediction
            out["prediction"] = {"change": p.change, "before": p.before, "after": p.after, "text": p.describe()}
        return out


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


Predictor = Callable[[Observation, dict[str, Any]], Prediction | None]


def diagnose(obs: Observation, model: StepTimeModel | None = None, simulate: bool = True) -> Diagnosis:
    predictor: Predictor = (lambda o, c: predict(o, c, model)) if simulate else (lambda o, c: None)
    result = Diagnosis()
    for rule in (queue_backed_up, arrivals_exceed, kv_full, long_prompts, preemption_thrash):
        finding = rule(obs, predictor)
        if finding is not None:
            result.findings.append(finding)
    finding = goodput_falls(obs, predictor, model or step_model_of(obs))
    if finding is not None:
        result.findings.append(finding)
    note = idle_with_empty_queue(obs)
    if note and not result.findings:
        result.notes.append(note)
    return result


def _waiting_steps(obs: Observation) -> list:
    return [s for s in obs.steps if s.waiting > 0]


def queue_backed_up(obs: Observation, predictor: Predictor) -> Finding | None:
    waiting = _waiting_steps(obs)
    if len(obs.steps) < MIN_STEPS or len(waiting) < WAITING_SHARE * len(obs.steps):
        return None
    mbs, mnt, blocks = obs.knob("max_batch_size"), obs.knob("max_num_tokens"), obs.knob("num_kv_blocks")
    cap_bound = obs.share_of_steps(lambda s: s.seqs >= mbs, waiting)
    budget_bound = obs.share_of_steps(lambda s: s.tokens >= 0.9 * mnt, waiting)
    kv_bound = obs.share_of_steps(lambda s: blocks and s.kv_blocks_used >= 0.9 * blocks, waiting)
    evidence = [
        f"requests waited in {100 * len(waiting) / len(obs.steps):.0f}% of {len(obs.steps)} steps "
        f"(mean {obs.mean([s.waiting for s in obs.steps]):.1f} waiting)",
        f"in those steps the batch held {mbs} sequences (max_batch_size) {100 * cap_bound:.0f}% of the time, "
        f"filled max_num_tokens {mnt} {100 * budget_bound:.0f}%, KV >= 90% {100 * kv_bound:.0f}%",
    ]
    symptom = "requests queue while the batch is held below what the device could take"
    if cap_bound >= BOUND_SHARE and kv_bound < BOUND_SHARE:
        change = {"max_batch_size": mbs * 2}
        text = f"raise max_batch_size {mbs} -> {mbs * 2} (the KV pool is not the limit)"
    elif budget_bound >= BOUND_SHARE:
        change = {"max_num_tokens": mnt * 2}
        text = f"raise max_num_tokens {mnt} -> {mnt * 2}"
    elif kv_bound < BOUND_SHARE and str(obs.config.get("scheduler_policy")) != "max_utilization":
        change = {"scheduler_policy": "max_utilization"}
        text = (
            f"scheduler_policy {obs.config.get('scheduler_policy')} -> max_utilization (the policy holds requests back)"
        )
    else:
        return None  # held by the KV pool: kv_full says so
    return Finding("queue_backed_up", symptom, evidence, text, predictor(obs, change))


def _queue_trend(obs: Observation) -> tuple[float, float]:
    """Waiting requests at the window's start and end (the first and last tenth of the steps when the window's ends
    were not seen)."""
    if obs.waiting_start or obs.waiting_end:
        return float(obs.waiting_start), float(obs.waiting_end)
    tenth = max(1, len(obs.steps) // 10)
    return obs.mean([s.waiting for s in obs.steps[:tenth]]), obs.mean([s.waiting for s in obs.steps[-tenth:]])


def arrivals_exceed(obs: Observation, predictor: Predictor) -> Finding | None:
    if len(obs.steps) < MIN_STEPS:
        return None
    start, end = _queue_trend(obs)
    arrivals, completions = obs.arrival_rate, obs.completion_rate
    grew = end - start >= max(3.0, 0.25 * obs.knob("max_batch_size", 1))
    if not grew or arrivals <= 0 or arrivals < QUEUE_GROWTH * completions:
        return None
    if completions:
        ratio = arrivals / completions
        replicas, how_much = math.ceil(ratio), f"{ratio:.2f}x the throughput"
        finished = f"{completions:.2f}/s finished over {obs.duration_s:.0f} s ({ratio:.2f}x)"
    else:  # not one request finished in the window: the ratio is unknown, more than one engine is not
        replicas, how_much = 2, "more throughput (no request finished in the window: watch longer for the ratio)"
        finished = f"none finished in {obs.duration_s:.0f} s"
    evidence = [
        f"{arrivals:.2f} requests/s arrived, {finished}",
        f"the waiting queue grew from {start:.0f} to {end:.0f}; the device was busy {100 * obs.busy_share:.0f}% "
        "of the time",
    ]
    text = (f"add capacity: at least {replicas} replicas (serve --replicas {replicas}) for {how_much}, or admit "
            "less (max_waiting_requests answers 429 beyond a bound)")  # fmt: skip
    return Finding("arrivals_exceed", "the queue grows: requests arrive faster than the engine finishes them",
                   evidence, text, predictor(obs, {"replicas": replicas}))  # fmt: skip


def kv_full(obs: Observation, predictor: Predictor) -> Finding | None:
    blocks, mnt = obs.knob("num_kv_blocks"), obs.knob("max_num_tokens")
    if len(obs.steps) < MIN_STEPS or not blocks or obs.kv_usage_peak < KV_FULL:
        return None
    full_share = obs.share_of_steps(lambda s: s.kv_blocks_used >= 0.9 * blocks)
    mean_tokens = obs.mean([s.tokens for s in obs.steps])
    if full_share < 0.2 or mean_tokens >= 0.9 * mnt:
        return None
    frag, block_size = obs.fragmentation, obs.knob("block_size", 16)
    evidence = [
        f"KV usage peaked at {100 * obs.kv_usage_peak:.0f}% of {blocks} blocks and sat at >= 90% in "
        f"{100 * full_share:.0f}% of the steps",
        f"while steps computed {mean_tokens:.0f} tokens on average of max_num_tokens {mnt}: memory, not the "
        "token budget, bounds the batch",
        f"{100 * frag:.0f}% of the allocated KV slots hold no token (block_size {block_size})",
    ]
    if frag >= FRAGMENTED and block_size > 8:
        change = {"block_size": block_size // 2}
        text = f"smaller blocks: block_size {block_size} -> {block_size // 2} (fragmentation {100 * frag:.0f}%)"
    else:
        more = int(blocks * 1.5)
        change = {"num_kv_blocks": more}
        text = (f"more KV memory: num_kv_blocks {blocks} -> {more} (or a larger kv_cache_memory_fraction); "
                "enable_prefix_caching if prompts share prefixes")  # fmt: skip
    return Finding("kv_full", "out of KV memory: the pool is full before the token budget is", evidence, text,
                   predictor(obs, change))  # fmt: skip


def long_prompts(obs: Observation, predictor: Predictor) -> Finding | None:
    if len(obs.requests) < MIN_REQUESTS:
        return None
    ttft50, ttft99 = obs.latency("ttft_s", 50), obs.latency("ttft_s", 99)
    median = obs.prompt_len(50)
    if not ttft50 or not ttft99 or ttft99 < TAIL_RATIO * ttft50 or not median:
        return None
    long = [r for r in obs.requests if r.prompt_tokens >= LONG_PROMPT_RATIO * median]
    total = sum(r.prompt_tokens for r in obs.requests)
    long_share = sum(r.prompt_tokens for r in long) / total if total else 0.0
    if not long or long_share < LONG_PROMPT_TOKEN_SHARE:
        return None
    cap = int(LONG_PROMPT_RATIO * median)
    evidence = [
        f"TTFT p50 {1000 * ttft50:.0f} ms, p99 {1000 * ttft99:.0f} ms ({ttft99 / ttft50:.1f}x)",
        f"{len(long)} of {len(obs.requests)} requests have prompts of >= {LONG_PROMPT_RATIO:.0f}x the median "
        f"{median:.0f} tokens (up to {max(r.prompt_tokens for r in long)}) and hold {100 * long_share:.0f}% of "
        "the prompt tokens: their prefills fill the step budget the others wait for",
    ]
    text = (f"schedule short requests first: scheduling_order shortest_first (or priority); or cap "
            f"max_input_len at ~{cap} tokens ({LONG_PROMPT_RATIO:.0f}x the median prompt: the {len(long)} longer "
            "ones would be refused, or truncated with truncation=left)")  # fmt: skip
    return Finding("long_prompts", "a few very slow requests: long prompts hold the window", evidence, text,
                   predictor(obs, {"scheduling_order": "shortest_first"}))  # fmt: skip


def preemption_thrash(obs: Observation, predictor: Predictor) -> Finding | None:
    preemptions, finished = obs.preemptions, max(1, len(obs.requests))
    if preemptions < 5 or preemptions < THRASH_PER_REQUEST * finished:
        return None
    preempting = [s for s in obs.steps if s.preempted]
    running = obs.mean([s.running + s.preempted for s in preempting]) or obs.knob("max_batch_size")
    mbs = obs.knob("max_batch_size")
    lower = max(1, min(mbs - 1, _sequences_that_fit(obs) or int(running * 0.75)))
    evidence = [
        f"{preemptions} preemptions for {len(obs.requests)} finished requests "
        f"({preemptions / finished:.2f} a request) in {len(preempting)} of {len(obs.steps)} steps",
        f"about {running:.0f} requests ran when one was preempted; KV usage peaked at "
        f"{100 * obs.kv_usage_peak:.0f}%: each preemption recomputes the request's prompt and output so far",
    ]
    text = (f"run fewer at once: max_batch_size {mbs} -> {lower}; or preemption_mode swap, or more KV memory "
            "(num_kv_blocks)")  # fmt: skip
    return Finding("preemption_thrash", "preemption thrash: requests are evicted and recomputed over and over",
                   evidence, text, predictor(obs, {"max_batch_size": lower}))  # fmt: skip


def _sequences_that_fit(obs: Observation) -> int:
    """How many requests of the observed mean length the KV pool holds at their longest (0: unknown)."""
    blocks, block_size = obs.knob("num_kv_blocks"), obs.knob("block_size", 16)
    if not obs.requests or not blocks:
        return 0
    longest = obs.mean([r.prompt_tokens + r.output_tokens for r in obs.requests])
    return blocks // max(1, math.ceil(longest / block_size))


def idle_with_empty_queue(obs: Observation) -> str | None:
    if not obs.steps and not obs.requests:
        return f"no traffic in the {obs.duration_s:.0f} s window: nothing to judge"
    if obs.busy_share < 0.5 and obs.share_of_steps(lambda s: s.waiting > 0) < 0.1:
        return (f"the device was busy {100 * obs.busy_share:.0f}% of the window and the waiting queue was empty: "
                f"throughput is bound by the arrivals ({obs.arrival_rate:.2f} requests/s), not by the engine")  # fmt: skip
    return None


def goodput_falls(obs: Observation, predictor: Predictor, model: StepTimeModel | None) -> Finding | None:
    targets = goodput.targets_of(obs)
    if targets is None or len(obs.requests) < goodput.MIN_REQUESTS:
        return None
    misses = goodput.count_misses(obs, targets)
    if misses.attainment >= goodput.GOODPUT_TARGET:
        return None
    evidence = [
        f"{misses.met} of {misses.total} requests ({100 * misses.attainment:.0f}%) met {targets.describe()}: "
        f"{misses.ttft} missed the TTFT target, {misses.tpot} the TPOT target",
    ]
    budget = goodput.prefill_budget(model, obs, targets.tpot_s) if targets.tpot_s else None
    mixed = goodput.long_chunk_steps(obs, budget) if budget else 0
    if misses.tpot >= misses.ttft and budget and mixed >= goodput.LONG_CHUNK_SHARE * len(obs.steps):
        evidence.append(f"in {mixed} of {len(obs.steps)} steps the decodes shared the step with more than {budget} "
                        "prompt tokens, the most a step can carry and stay inside the TPOT target")  # fmt: skip
        change = {"long_prefill_token_threshold": budget, "max_long_partial_prefills": 1}
        text = (f"isolate long prompts: long_prefill_token_threshold {budget} and max_long_partial_prefills 1 (a "
                "long prompt is prefilled in chunks the running decodes can absorb)")  # fmt: skip
    elif misses.ttft and _waiting_steps(obs):
        evidence.append(f"requests waited in {100 * len(_waiting_steps(obs)) / max(1, len(obs.steps)):.0f}% of the "
                        "steps: the late ones were served in arrival order behind requests already late")  # fmt: skip
        change = {"slo_admission": "deprioritize"}
        text = ("SLO-aware admission: slo_admission deprioritize (requests that can still meet the TTFT target go "
                "first), or refuse (a 503 with Retry-After for the ones that cannot, for clients that retry "
                "elsewhere); past that, more capacity")  # fmt: skip
    else:
        return None
    return Finding("goodput_falls", "goodput falls: too few requests meet the service-level targets", evidence, text,
                   predictor(obs, change))  # fmt: skip
