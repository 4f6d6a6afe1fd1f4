"""Offline API shaped like vLLM's: LLM(model=None, **engine_options).generate(prompts, sampling_params).

Unless num_kv_blocks or kv_cache_memory_fraction is set, the KV pool is sized to the requests: one block at load, and
at each generate() what its batch needs at worst (prompt + max_tokens of every request that can run at once), at most
what the default memory fraction allows; it only grows. A server's pool, sized to the memory, is the other case.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from batchserve.config import EngineConfig
from batchserve.engine.inputs import Prompt
from batchserve.engine.llm_engine import LLMEngine
from batchserve.engine.outputs import Completion
from batchserve.entrypoints import llm_pooling
from batchserve.entrypoints.engine_options import engine_config
from batchserve.entrypoints.llm_pooling import EmbeddingOutput, ScoreOutput
from batchserve.host.process import configure_torch
from batchserve.request import EngineRequest, LoRARequest
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from batchserve.serving.chat import chat_prompt_ids
from batchserve.serving.structured import ConstraintChecker

Message = Mapping[str, Any]


# The pool at load when it is sized to the requests: the first generate() grows it to what its batch needs.
INITIAL_KV_BLOCKS = 1


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        config = engine_config({"model": model, **engine_options}, "LLM(...)")  # names and types checked here
        self.engine = LLM.from_config(config).engine

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over a new engine; as an entry point it sets torch's thread count and seed from `config`. Its KV
        pool is sized to the requests unless `config` sets num_kv_blocks or kv_cache_memory_fraction."""
        configure_torch(config.num_threads, config.seed)
        cache = config.cache
        sized_to_requests = cache.num_kv_blocks is None and cache.kv_cache_memory_fraction is None
        return cls.from_engine(LLMEngine(config, initial_kv_blocks=INITIAL_KV_BLOCKS if sized_to_requests else None))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @functools.cached_property
    def _constraints(self) -> ConstraintChecker:
        return ConstraintChecker(self.tokenizer)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion with continuous batching; outputs come back in input order. All prompts
        are admitted or none: a bad one raises InvalidRequestError and leaves nothing behind in the engine. A pool
        sized to the requests first grows to this batch's worst case (see the module's docstring)."""
        prompts = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidRequestError(f"{len(priorities)} priorities for {len(prompts)} prompts", "priority")
        # every request built (prompts tokenized, everything checked) before the pool grows and before any is admitted
        build, new_id = self.engine.requests.from_prompt, self.engine.new_request_id
        requests = [build(new_id(), prompt, p, prio) for prompt, p, prio in zip(prompts, params, priorities)]
        requests = self._with_adapters(requests, lora_request)
        for constraint in {r.sampling_params.structured_outputs for r in requests}:
            self._constraints.check_blocking(constraint)  # a bad schema raises here, as it is a 400 over HTTP
        return self.run_requests(requests, use_tqdm)

    def run_requests(self, requests: list[EngineRequest], use_tqdm: bool = False) -> list[Completion]:
        """Requests built by the engine's builder, all admitted or none, run to completion, in input order."""
        self.engine.reserve_kv_for([(r.num_prompt_tokens, r.sampling_params.max_tokens) for r in requests])
        ids: list[str] = []
        try:
            for request in requests:
                ids.append(self.engine.add_request(request))
        except BaseException:
            self.engine.abort_request(ids)
            self.engine.step()  # reports the aborts, so the engine forgets them now
            raise
        return self._run(requests, use_tqdm)

    def _with_adapters(
        self, requests: list[EngineRequest], lora: LoRARequest | Sequence[LoRARequest | None] | None
    ) -> list[EngineRequest]:
        """Each request with its adapter (vLLM's lora_request: one for all, or one per prompt), served from now on."""
        loras = list(lora) if isinstance(lora, Sequence) else [lora] * len(requests)
        if len(loras) != len(requests):
            raise InvalidRequestError(f"{len(loras)} lora requests for {len(requests)} prompts", "lora_request")
        for adapter in {a for a in loras if a is not None}:
            self.engine.add_lora(adapter)
        return [r if a is None else _with_adapter(r, a.lora_name) for r, a in zip(requests, loras)]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[Completion]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the model's chat template."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidRequestError("messages must be a conversation or a list of conversations", "messages")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts: list[Prompt] = [
            {"prompt_token_ids": chat_prompt_ids(self.tokenizer, conv, add_generation_prompt)} for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], **options: Any) -> list[EmbeddingOutput]:
        """Embeddings of texts or token ids on a pooling engine (--runner pooling): options dimensions, normalize,
        truncate_prompt_tokens, use_tqdm (entrypoints/llm_pooling.py)."""
        return llm_pooling.embed(self, prompts, **options)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], **options: Any) -> list[ScoreOutput]:
        """Scores of text pairs (one text_1 against each text_2, or pairwise): a classifier's on the pair, or the
        cosine of an embedding model's; options truncate_prompt_tokens, use_tqdm."""
        return llm_pooling.score(self, text_1, text_2, **options)

    def _run(self, requests: list[EngineRequest], use_tqdm: bool) -> list[Completion]:
        """Step until every request finished, folding each step's deltas into its Completion."""
        completions = {r.request_id: Completion.of(r) for r in requests}
        unfinished = len(completions)
        with tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while unfinished:
                for delta in self.engine.step():
                    completion = completions.get(delta.request_id)
                    if completion is None:
                        continue
                    completion.add(delta)
                    if delta.finished:
                        unfinished -= 1
                        bar.update(1)
        return list(completions.values())


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError("prompts must be a prompt or a non-empty list of prompts", "prompt")
    return list(prompts)


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if not isinstance(sampling_params, Sequence) or not all(isinstance(p, SamplingParams) for p in sampling_params):
        raise InvalidRequestError("sampling_params must be a SamplingParams or a list of them", "sampling_params")
    if len(sampling_params) != count:
        raise InvalidRequestError(f"{len(sampling_params)} sampling params for {count} prompts", "sampling_params")
    return list(sampling_params)


def _with_adapter(request: EngineRequest, lora_name: str) -> EngineRequest:
    return dataclasses.replace(
        request, sampling_params=dataclasses.replace(request.sampling_params, lora_name=lora_name)
    )
