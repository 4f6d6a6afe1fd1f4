"""The one set of test doubles: a tiny ModelConfig, the byte-level tokenizer, the FakeRunner (tests/fake_runner.py)
and the REAL LLMEngine built over them. tests/conftest.py turns them into fixtures (`tokenizer`, `make_engine`);
plain code (server fakes, subprocess scripts, helpers) imports them from here.

The tokenizer is byte-level: it encodes any text, ids 0-25 are the letters a-z, and the engine's runner samples only
ids below LETTERS by default, so generated text is readable and `tokenizer.decode(ids)` is exact. It has the
specials of a ChatML model (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` = EOS) and a chat template.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from batchserve.config import EngineConfig, ModelConfig
from batchserve.engine.llm_engine import LLMEngine
from batchserve.engine.outputs import Completion, CompletionDelta
from tests.fake_runner import FakeRunner, reference_generation, reference_next_token

__all__ = [
    "CHAT_TEMPLATE",
    "LETTERS",
    "SPECIALS",
    "FakeRunner",
    "byte_tokenizer",
    "make_engine",
    "reference_generation",
    "reference_next_token",
    "run_to_completion",
    "tiny_model_config",
]

LETTERS = 26  # ids 0-25 are "a".."z"; the fake runner samples among them by default
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT_OPTIONS = {"num_kv_blocks": 256, "num_swap_blocks": 32, "max_model_len": 256}
DEFAULT_MODEL_LEN = 2048  # the tiny model's context when the config sets no max_model_len


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE without merges: one token per byte of UTF-8, letters a-z first, then the specials."""
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


def tiny_model_config(
    vocab_size: int, max_len: int = 256, eos_token_ids: list[int] | tuple[int, ...] = ()
) -> ModelConfig:
    """The shapes of a one-layer model nobody runs: the engine reads only vocab_size, the context and the EOS ids."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=max_len,
        eos_token_ids=list(eos_token_ids),
    )


def make_engine(
    config: EngineConfig | None = None,
    *,
    delay_s: float = 0.0,
    runner_vocab: int = LETTERS,
    tokenizer: Any = None,
    max_kv_blocks: int | None = None,
    **options: Any,
) -> LLMEngine:
    """The real LLMEngine (scheduler, KV manager, detokenizer) over the FakeRunner and the byte tokenizer.

    Give an EngineConfig, or flat options as `EngineConfig.from_options` takes them, on top of DEFAULT_OPTIONS (256
    KV blocks, 32 swap blocks, max_model_len 256). `delay_s` is the runner's sleep per non-empty step; the runner
    samples ids below `runner_vocab` (letters by default), so it never emits EOS by itself. `max_kv_blocks` above
    num_kv_blocks: a pool that starts at num_kv_blocks and grows up to it (the offline LLM's, sized to the requests).
    """
    if config is None:
        config = EngineConfig.from_options(**(DEFAULT_OPTIONS | options))
    elif options:
        raise TypeError("make_engine takes an EngineConfig or flat options, not both")
    cache = config.cache
    num_kv_blocks = cache.num_kv_blocks or DEFAULT_OPTIONS["num_kv_blocks"]
    num_swap_blocks = DEFAULT_OPTIONS["num_swap_blocks"] if cache.num_swap_blocks is None else cache.num_swap_blocks
    tokenizer = byte_tokenizer() if tokenizer is None else tokenizer
    model_config = tiny_model_config(
        len(tokenizer), config.scheduler.max_model_len or DEFAULT_MODEL_LEN, [tokenizer.eos_token_id]
    )
    runner = FakeRunner(
        num_kv_blocks, cache.block_size, runner_vocab, num_swap_blocks, delay_s=delay_s, max_kv_blocks=max_kv_blocks
    )
    return LLMEngine(config, runner=runner, tokenizer=tokenizer, model_config=model_config)


def run_to_completion(
    engine: LLMEngine, max_steps: int = 10_000, earlier: Iterable[CompletionDelta] = ()
) -> dict[str, Completion]:
    """Step until nothing is unfinished; each finished request's output by id, folded from its deltas (token ids,
    text, logprobs; the prompt is the caller's, not known here), `earlier` ones first (of steps the caller ran).
    Fails past `max_steps` steps, so a scheduler that never finishes a request fails the test instead of hanging."""
    running: dict[str, Completion] = {}
    done: dict[str, Completion] = {}

    def fold(out: CompletionDelta) -> None:
        completion = running.get(out.request_id)
        if completion is None:
            logprobs = [] if out.delta_logprobs is not None else None
            completion = running[out.request_id] = Completion(out.request_id, None, [], logprobs)
        completion.add(out)
        if out.finished:
            done[out.request_id] = running.pop(out.request_id)

    for out in earlier:
        fold(out)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            fold(out)
    raise AssertionError(
        f"requests still unfinished after {max_steps} engine steps: {engine.last_stats} "
        f"(finished so far: {sorted(done)})"
    )
