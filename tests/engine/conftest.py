import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from batchserve.config import EngineConfig, ModelConfig
from batchserve.engine.llm_engine import LLMEngine
from tests.fake_runner import FakeRunner

VOCAB = 1000


@pytest.fixture(scope="session")
def word_tokenizer():
    """w0 .. w999, one token per word: text and ids map one to one, so text assertions are exact."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def fake_model_config(max_len=256) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=8, max_position_embeddings=max_len, eos_token_ids=[0])


@pytest.fixture
def make_engine(word_tokenizer):
    def make(num_blocks=64, max_len=256, **options):
        config = EngineConfig.from_options(**{"block_size": 8, "num_kv_blocks": num_blocks} | options)
        runner = FakeRunner(num_blocks, config.cache.block_size, VOCAB, num_swap_blocks=32)
        return LLMEngine(config, runner=runner, tokenizer=word_tokenizer, model_config=fake_model_config(max_len))
    return make
