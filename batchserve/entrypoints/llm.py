"""Offline API shaped like vLLM's: LLM(model=None, **engine_options).generate(prompts, sampling_params)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from batchserve.config import EngineConfig
from batchserve.engine.llm_engine import CompletionOutput, LLMEngine, Prompt
from batchserve.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **engine_options))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion with continuous batching; outputs come back in input order."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        ids = [
            self.engine.add_request(None, prompt, p, priority=priority[i] if priority else 0)
            for i, (prompt, p) in enumerate(zip(prompts, params))
        ]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[CompletionOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt_token_ids": self._apply_chat_template(conv, add_generation_prompt)} for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _apply_chat_template(self, conversation: list[Message], add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    @staticmethod
    def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"{len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[CompletionOutput]:
        finished: dict[str, CompletionOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while wanted - finished.keys():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[rid] for rid in request_ids]
