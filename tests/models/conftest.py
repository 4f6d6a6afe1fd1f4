"""Tiny randomly initialised transformers models, saved to disk so they go through our loader."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.core.outputs import CachedRequestData, ModelOutput, NewRequestData, SchedulerOutput
from batchserve.models.loader import load_model, load_model_config
from batchserve.sampling_params import SamplingParams
from batchserve.worker.model_runner import ModelRunner
from tests.forcing import force_gemm, force_lora_path, force_prefill  # noqa: F401  (fixtures of the tests here)
from tests.tiny_models import KINDS, VOCAB, build_hf_model, hf_greedy  # noqa: F401  (re-exported to tests)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> (hf model, saved directory); each kind built once per session."""
    cache: dict[str, tuple[nn.Module, Path]] = {}

    def get(kind: str):
        if kind not in cache:
            directory = tmp_path_factory.mktemp(kind)
            cache[kind] = (build_hf_model(kind, directory), directory)
        return cache[kind]

    return get


def load_ours(directory: Path, dtype=torch.float32) -> tuple[ModelConfig, nn.Module]:
    config = load_model_config(directory)
    return config, load_model(directory, config, dtype, torch.device("cpu"))


def make_runner(directory: Path, block_size: int = 16, num_kv_blocks: int = 64, num_swap_blocks: int = 0):
    model_config, model = load_ours(directory)
    engine_config = EngineConfig(
        model=str(directory),
        device="cpu",
        scheduler=SchedulerConfig(preemption_mode="swap" if num_swap_blocks else "recompute"),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, num_swap_blocks=num_swap_blocks),
    )
    return ModelRunner(engine_config, model_config, model, torch.device("cpu"), torch.float32)


class MiniScheduler:
    """Just enough of a scheduler to drive a ModelRunner by the contract: chunked prefill, mixed batches, scattered
    block ids, recompute or swap preemption, and prefix-cache style admission with precomputed blocks."""

    def __init__(self, runner: ModelRunner, chunk: int, seed: int = 0):
        self.runner = runner
        self.chunk = chunk
        self.block_size = runner.block_size
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)  # block tables are never contiguous
        self.free_host = list(range(runner.num_swap_blocks))
        self.reqs: dict[str, dict] = {}
        self.pending_finished: set[str] = set()
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []

    def add(self, req_id: str, prompt: list[int], max_tokens: int, blocks: list[int] | None = None, computed: int = 0):
        self.reqs[req_id] = dict(
            tokens=list(prompt),
            num_prompt=len(prompt),
            computed=computed,
            blocks=list(blocks or []),
            max_tokens=max_tokens,
            out=[],
            new=True,
            done=False,
            host_blocks=None,
            paused=False,
        )

    def preempt(self, req_id: str, mode: str) -> None:
        r = self.reqs[req_id]
        self.pending_finished.add(req_id)
        r["new"] = True
        if mode == "swap":
            r["host_blocks"] = [self.free_host.pop() for _ in r["blocks"]]
            self.swap_out += list(zip(r["blocks"], r["host_blocks"], strict=True))
        else:
            r["computed"] = 0
        self.free += r["blocks"]
        r["blocks"] = []
        r["paused"] = True

    def resume(self, req_id: str) -> None:
        self.reqs[req_id]["paused"] = False

    def _allocate(self, r: dict, num_tokens: int) -> list[int]:
        need = math.ceil(num_tokens / self.block_size) - len(r["blocks"])
        new = [self.free.pop() for _ in range(max(need, 0))]
        r["blocks"] += new
        return new

    def step(self) -> ModelOutput:
        out = SchedulerOutput(finished_req_ids=self.pending_finished, blocks_to_swap_out=self.swap_out)
        self.pending_finished, self.swap_out = set(), []
        new_ids, cached = [], []
        for req_id, r in self.reqs.items():
            if r["done"] or r["paused"]:
                continue
            if r["new"] and r["host_blocks"] is not None:  # resume a swapped-out request
                self._allocate(r, r["computed"])
                out.blocks_to_swap_in += list(zip(r["blocks"], r["host_blocks"], strict=True))
                self.free_host += r["host_blocks"]
                r["host_blocks"] = None
            n = min(self.chunk, len(r["tokens"]) - r["computed"])
            new_blocks = self._allocate(r, r["computed"] + n)
            out.num_scheduled_tokens[req_id] = n
            if r["new"]:
                new_ids.append(req_id)
                out.new_requests.append(
                    NewRequestData(
                        req_id,
                        list(r["tokens"]),
                        r["num_prompt"],
                        SamplingParams(temperature=0.0),
                        list(r["blocks"]),
                        r["computed"],
                    )
                )
                r["new"] = False
            else:
                cached.append(req_id)
                out.cached_requests.append(CachedRequestData(req_id, new_blocks, r["computed"]))
        # batch order: new requests first, then cached
        out.num_scheduled_tokens = {k: out.num_scheduled_tokens[k] for k in new_ids + cached}
        result = self.runner.execute(out)
        for req_id, n in out.num_scheduled_tokens.items():
            self.reqs[req_id]["computed"] += n
        for req_id, token in zip(result.req_ids, result.sampled_token_ids, strict=True):
            r = self.reqs[req_id]
            assert r["computed"] == len(r["tokens"]), "sampled a request that had not computed all its tokens"
            r["tokens"].append(token)
            r["out"].append(token)
            if len(r["out"]) == r["max_tokens"]:
                r["done"] = True
                self.pending_finished.add(req_id)
                self.free += r["blocks"]
        return result

    def run(self, max_steps: int = 500, hooks: dict | None = None) -> dict[str, list[int]]:
        for i in range(max_steps):
            if hooks and i in hooks:
                hooks[i](self)
            if all(r["done"] for r in self.reqs.values()):
                if self.pending_finished:
                    self.step()  # an empty step that tells the worker to forget the finished requests
                break
            self.step()
        return {k: r["out"] for k, r in self.reqs.items()}


def staggered_outputs(runner, chunk: int, prompts: dict[str, list[int]], max_new: dict[str, int]) -> dict:
    """Greedy outputs of requests "a", "b" and "c" joining one batch at steps 0 ("b"), 2 ("a") and 3 ("c"), prompts
    prefilled in chunks of `chunk` beside the others' decodes."""
    sched = MiniScheduler(runner, chunk=chunk)
    sched.add("b", prompts["b"], max_new["b"])
    return sched.run(hooks={2: lambda s: s.add("a", prompts["a"], max_new["a"]),
                            3: lambda s: s.add("c", prompts["c"], max_new["c"])})  # fmt: skip


class CountingLoop:
    """The native decoder loop, its forward calls counted (it is a C++ object: no attribute to spy on)."""

    def __init__(self, loop):
        self.loop, self.calls = loop, 0

    def forward(self, *args):
        self.calls += 1
        return self.loop.forward(*args)
