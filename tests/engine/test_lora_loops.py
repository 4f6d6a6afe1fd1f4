"""The ways of applying the deltas that benchmarks/lora.py compares grouping by adapter against (worker/lora_slots.py
LoRAPool.grouping and delta_kernel): each request its own group in the native kernel, a torch loop over requests, and
the torch code grouped by adapter. Each is a real way of running the step, so each must give, in a batch mixed with
the base model and other adapters, the greedy float32 tokens of transformers + PEFT one prompt at a time; the torch
ways must run the torch code (else the benchmark would time the native kernel twice under other names)."""

from __future__ import annotations

import pytest

from batchserve import LLM
from batchserve.layers.lora import LoRASlots
from tests.engine.test_lora import GREEDY, lora_requests, prompts
from tests.tiny_loras import make_adapters, peft_greedy
from tests.tiny_models import hf_greedy, tiny_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf_model, base_dir = tiny_checkpoint(tmp_path_factory, "llama", "lora_loops_llama")
    hf_model.generation_config.eos_token_id = None
    return hf_model, base_dir, make_adapters(base_dir, tmp_path_factory.mktemp("adapters_loops"))


@pytest.mark.parametrize("grouping, kernel", [("request", "native"), ("request", "torch"), ("adapter", "torch")])
def test_every_way_of_applying_the_deltas_equals_peft(llama, monkeypatch, grouping, kernel):
    hf_model, base_dir, adapters = llama
    loras = lora_requests(adapters)
    names = [None, "sql", "poet", "sql", "chat", "poet"]
    batch = prompts(len(names), seed=3)
    llm = LLM(model=str(base_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=3, num_kv_blocks=256)
    pool = llm.engine.runner.lora
    pool.grouping, pool.delta_kernel = grouping, kernel
    torch_calls = []
    real_torch_delta = LoRASlots.torch_delta

    def counted(self, x, y, step):
        torch_calls.append(len(step.groups))
        return real_torch_delta(self, x, y, step)

    monkeypatch.setattr(LoRASlots, "torch_delta", counted)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False,
        lora_request=[None if n is None else loras[n] for n in names],
    )  # fmt: skip
    for name, prompt, out in zip(names, batch, outs):
        want = hf_greedy(hf_model, prompt, 10) if name is None else peft_greedy(adapters[name], prompt, 10)
        assert out.outputs[0].token_ids == want, name
    if kernel == "torch":
        assert torch_calls, "the torch code never ran"
        # one group a request (five adapter requests while all run) or one an adapter (three)
        assert max(torch_calls) == (5 if grouping == "request" else 3)
    elif llm.engine.runner.model.decoder_loop is not None:
        assert not torch_calls  # the native kernel took every delta
