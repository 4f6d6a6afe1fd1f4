"""Prompt-token logprobs (scoring) on a tiny random Llama: computed in the batched, chunked prefill, they equal
transformers' log-softmax at every prompt position, whatever the chunking, the batch or a cached prefix."""

from __future__ import annotations

import random

import pytest
import torch

from batchserve.engine.llm_engine import LLMEngine
from batchserve.sampling_params import SamplingParams
from tests.tiny_models import VOCAB, tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "llama", "tiny_llama_scoring")


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


def run(directory, prompts, params, **options):
    engine = LLMEngine.from_options(model=str(directory), device="cpu", dtype="float32", num_kv_blocks=128, **options)
    outputs = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_prompt(str(i), prompt, p)
    for _ in range(500):
        for out in engine.step():
            if out.prompt_logprobs is not None:
                outputs[int(out.request_id)] = out.prompt_logprobs
        if not engine.has_unfinished_requests():
            break
    return [outputs.get(i) for i in range(len(prompts))]


@pytest.mark.parametrize("max_num_tokens", [512, 7])  # one prefill, or prompts cut in chunks of a few tokens
def test_prompt_logprobs_equal_transformers(tiny, max_num_tokens):
    hf_model, directory = tiny
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 23, 40)]
    prompts.append(prompts[3][:32] + [5, 6, 7])  # shares two full blocks with the one before: no cache hit taken
    params = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3) for _ in prompts]
    params.insert(1, SamplingParams(max_tokens=2))  # a request that does not score rides in the same batches
    prompts.insert(1, [4, 5, 6])
    got = run(directory, prompts, params, max_num_tokens=max_num_tokens, block_size=16)
    assert got[1] is None
    for prompt, scores in zip(prompts, got):
        if scores is None:
            continue
        assert len(scores) == len(prompt) and scores[0] is None
        expected = hf_prompt_logprobs(hf_model, prompt)
        assert [s.token_id for s in scores[1:]] == prompt[1:]
        torch.testing.assert_close(torch.tensor([s.logprob for s in scores[1:]]), expected, atol=1e-4, rtol=1e-4)
        for s in scores[1:]:
            assert len(s.top) == 3 and max(s.top.values()) >= s.logprob - 1e-6
            assert (s.rank == 1) == (s.logprob >= max(s.top.values()) - 1e-6)
