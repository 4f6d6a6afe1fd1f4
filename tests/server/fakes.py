"""A model-free LLMEngine for fast server tests: the real engine, scheduler and detokenizer over the shared
FakeRunner and a tiny byte-level tokenizer whose first 26 ids are the letters a-z (so generated text is readable)."""

from __future__ import annotations

import threading
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from batchserve.config import EngineConfig, ModelConfig
from batchserve.engine.llm_engine import LLMEngine
from tests.fake_runner import FakeRunner

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    ordered = letters + sorted(set(alphabet) - set(letters))
    vocab = {ch: i for i, ch in enumerate(ordered)}
    for special in SPECIALS:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


class SlowFakeRunner(FakeRunner):
    """FakeRunner with a per-step delay (so streams and queues are observable) and a switch that crashes it."""

    def __init__(self, *args, delay_s: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s
        self.crash = threading.Event()

    def execute(self, out):
        if self.crash.is_set():
            raise RuntimeError("simulated device failure")
        if self.delay_s and not out.is_empty:
            time.sleep(self.delay_s)
        return super().execute(out)


def fake_engine(delay_s: float = 0.005, num_kv_blocks: int = 256, **options) -> LLMEngine:
    options = {"max_model_len": 256, "max_batch_size": 8, "block_size": 16, **options}
    config = EngineConfig.from_options(**options)
    tokenizer = byte_tokenizer()
    model_config = ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=options["max_model_len"],
        eos_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
    )
    runner = SlowFakeRunner(num_kv_blocks, config.cache.block_size, vocab_size=26, delay_s=delay_s)
    return LLMEngine(config, runner=runner, tokenizer=tokenizer, model_config=model_config)
