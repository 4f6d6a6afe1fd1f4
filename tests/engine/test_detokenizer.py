"""Incremental detokenization (batchserve/engine/detokenizer.py): the stream of a request's output reads as the
output does after its prompt, on the decoders that treat a text's first token apart (WordPiece, SentencePiece's
Metaspace) and on byte-level BPE, whose characters can span tokens."""

from __future__ import annotations

import random

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from batchserve.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from tests.tiny_models import save_word_tokenizer, text_after


def _metaspace_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, **{f"\u2581w{i}": i + 1 for i in range(20)}, **{f"x{i}": i + 21 for i in range(20)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _streamed(tokenizer, prompt: list[int], output: list[int]) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, context=prompt)
    text = ""
    for token in output:
        detokenizer.add_token(token)
        text += detokenizer.take_delta(finished=False)
    return text + detokenizer.take_delta(finished=True)


def test_the_first_token_keeps_its_space_after_a_prompt_on_a_metaspace_decoder():
    tokenizer = _metaspace_tokenizer()
    prompt, output = tokenizer.encode("w1 w2", add_special_tokens=False), [5, 6]
    assert tokenizer.decode(output) == "w4 w5"  # decoded alone, the first token loses its space
    assert _streamed(tokenizer, prompt, output) == " w4 w5"
    assert _streamed(tokenizer, [], output) == "w4 w5"  # no prompt: the output begins the text


def test_the_first_token_keeps_its_space_after_a_prompt_on_a_wordpiece_decoder(tmp_path):
    save_word_tokenizer(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert _streamed(tokenizer, [3, 4], [7, 8]) == " w7 w8"


@pytest.mark.parametrize("seed", range(3))
def test_byte_level_streams_read_as_the_output_after_its_prompt(tokenizer, seed):
    """One byte a token (tests/doubles.py), text with 2- to 4-byte characters cut at random bytes: the cut can fall
    inside a character, between prompt and output or inside the output. The streamed text is the output's text as
    it reads after the prompt's tail; where the tail ends inside a character, as it reads alone."""
    rng = random.Random(seed)
    alphabet = "ab c\u00e9\u4e2d\U0001f600\n"
    for _ in range(40):
        ids = tokenizer.encode("".join(rng.choice(alphabet) for _ in range(12)), add_special_tokens=False)
        cut = rng.randrange(0, len(ids))
        prompt, output = ids[:cut], ids[cut:]
        if tokenizer.decode(prompt[-CONTEXT_TOKENS:]).endswith("\ufffd"):
            expected = tokenizer.decode(output).rstrip("\ufffd")  # a stream holds back what ends inside a character
        else:
            expected = text_after(tokenizer, prompt, output)
        assert _streamed(tokenizer, prompt, output) == expected, (prompt, output)


def test_the_prompts_special_tokens_stay_out_of_the_text(tokenizer):
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    output = tokenizer.encode("ok \u00e9", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert _streamed(tokenizer, prompt, output) == "ok \u00e9"
