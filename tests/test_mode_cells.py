"""The walk over the modes: every cell of dtype x weight format x KV pool x deterministic x speculative x family x
forced attention path starts a real engine on a tiny random model and comes out one of three ways, never silently:
refused at start with its rule's reason (ModeRefused, before anything is loaded), or running with each fallback of
the mode table (batchserve/modes.py) logged once, or running as asked; and a cell that runs gives max_tokens tokens,
exactly transformers' greedy tokens where nothing in it is lossy (float32, float weights, a float32 pool), the same
tokens alone as in a batch where deterministic mode covers it.

The product is reduced by what interacts, so the walk stays a few seconds of engine time:
- a refused cell costs nothing (the table refuses before the weights load), so every refused combination is walked;
- the gguf weight format is walked on the Llama family only: a GGUF file of the Gemma family runs through the same
  quantized layers (tests/models/test_gguf_families.py checks its loader), and the windowed/soft-capped family's
  interaction with the weights is the same for int8 and int4, which it walks;
- the KV pool of the other float dtype (a bfloat16 pool under a float32 model and the reverse) only changes the
  attention path, so it is walked with float weights, no speculation and no deterministic mode;
- the forced attention path (portable beside the path the CPU picks) matters only where the native attention kernels
  run: the Llama family (the windowed family attends by the torch code) with float weights (the weight format does
  not reach attention), with every KV pool (the 8-bit decode kernels differ by path), deterministic or not;
- speculation is walked with every weight format and pool: its verification rows are what differs from a plain step.
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass

import pytest

from batchserve import LLM, SamplingParams
from batchserve.layers import kernels
from batchserve.layers.attention import preferred_prefill_method
from batchserve.modes import ModeRefused
from tests.tiny_models import build_hf_model, hf_greedy, save_word_tokenizer

PROMPTS = [[5, 17, 33, 8, 61, 5, 17, 33], [40, 41, 3], [9, 10, 11] * 6]
TOKENS = 6
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
FAMILIES = {"llama": "llama_head64", "gemma2": "gemma2"}  # plain; windowed and soft-capped
AUTO = "auto"  # the attention path the CPU picks
FALLBACK_LINE = re.compile(r"^mode fallback (\w+): ")


@dataclass(frozen=True)
class Cell:
    family: str
    dtype: str
    weights: str  # quantization
    kv: str  # kv_cache_dtype
    deterministic: bool
    speculative: bool
    attention_path: str = AUTO

    @property
    def id(self) -> str:
        flags = ["det"] * self.deterministic + ["ngram"] * self.speculative
        return "-".join([self.family, self.dtype, self.weights, f"kv_{self.kv}", *flags, self.attention_path])

    @property
    def exact(self) -> bool:
        """Nothing lossy: transformers' float32 greedy tokens are the reference."""
        return self.dtype == "float32" and self.weights == "none" and self.kv in (AUTO, "float32")

    def options(self) -> dict:
        speculative = (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if self.speculative else None
        )
        return dict(
            dtype=self.dtype, quantization=self.weights, kv_cache_dtype=self.kv, deterministic=self.deterministic,
            speculative_config=speculative, device="cpu", num_kv_blocks=32, max_batch_size=4,
        )  # fmt: skip


def _other_float(dtype: str) -> str:
    return "bfloat16" if dtype == "float32" else "float32"


def cells() -> list[Cell]:
    walked = []
    for family, dtype, det, spec in itertools.product(FAMILIES, ("float32", "bfloat16"), (False, True), (False, True)):
        weights = ("none", "int8", "int4", "gguf") if family == "llama" else ("none", "int8", "int4")
        for weight, kv in itertools.product(weights, (AUTO, "int8", "fp8_e4m3")):
            paths = (AUTO, "portable") if family == "llama" and weight == "none" else (AUTO,)
            walked += [Cell(family, dtype, weight, kv, det, spec, path) for path in paths]
        if not det and not spec:
            walked.append(Cell(family, dtype, "none", _other_float(dtype), det, spec))
    return walked


CELLS = cells()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's tiny model (folder, transformers' float32 model), the Llama's GGUF file of Q8_0 codes; the GGUF's
    float parts converted into this module's own cache folder."""
    from tests.layers.test_gguf_as_stored import tiny_llama, write_quantized_gguf

    root = tmp_path_factory.mktemp("mode_cells")
    built = {}
    for family, kind in FAMILIES.items():
        folder = root / family
        built[family] = (folder, build_hf_model(kind, folder))
        save_word_tokenizer(folder)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHSERVE_CACHE_DIR", str(root / "cache"))
        write_quantized_gguf(tiny_llama(root / "gguf_hf", 64), root / "tiny-Q8_0.gguf", "Q8_0", patch)
        yield {**built, "gguf": root / "tiny-Q8_0.gguf"}


@pytest.fixture(scope="module")
def references(models):
    """transformers' float32 greedy tokens per family and prompt."""
    return {
        family: [hf_greedy(model, prompt, TOKENS) for prompt in PROMPTS]
        for family, (_, model) in ((f, models[f]) for f in FAMILIES)
    }


@pytest.fixture
def attention_path(monkeypatch):
    """force(path): the native attention kernels take `path` (AUTO: the CPU's choice), through the same cached choice
    every call reads; cleared around the test."""

    def force(path: str) -> None:
        if path != AUTO:
            if not kernels.attention_path_runs(path):
                pytest.skip(f"attention path {path} cannot run here")
            monkeypatch.setenv("BATCHSERVE_ATTENTION_PATH", path)
        kernels.attention_path.cache_clear()
        preferred_prefill_method.cache_clear()

    yield force
    kernels.attention_path.cache_clear()
    preferred_prefill_method.cache_clear()


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [out.token_ids for out in outputs]


def _start(cell: Cell, models, caplog) -> tuple[LLM | None, list[str], ModeRefused | None]:
    model = models["gguf"] if cell.weights == "gguf" else models[cell.family][0]
    with caplog.at_level(logging.INFO, logger="batchserve.modes"):
        caplog.clear()
        try:
            llm = LLM(model=str(model), **cell.options())
        except ModeRefused as refused:
            return None, [], refused
    logged = [m.group(1) for r in caplog.records if (m := FALLBACK_LINE.match(r.getMessage()))]
    return llm, logged, None


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_every_cell_runs_is_refused_or_says_its_fallback(cell, models, references, caplog, attention_path):
    attention_path(cell.attention_path)
    llm, logged, refused = _start(cell, models, caplog)
    if refused is not None:  # at start, each refused rule named with its reason
        assert refused.rules and all(rule.reason in str(refused) for rule in refused.rules)
        assert _expected_refusals(cell) <= {rule.name for rule in refused.rules}
        return
    assert not _expected_refusals(cell), f"{cell.id} should have been refused"
    decision = llm.engine.modes
    assert sorted(logged) == sorted(set(logged)) == sorted(decision.fallback_names)  # each fallback logged once
    assert _expected_fallbacks(cell) <= set(logged)
    if cell.speculative:  # speculation is on unless a logged fallback turned it off
        assert (llm.engine.scheduler.speculation is None) == ("static_policy_drops_speculation" in logged)
    batched = _generate(llm, PROMPTS)
    assert [len(tokens) for tokens in batched] == [TOKENS] * len(PROMPTS)
    assert all(0 <= t < llm.engine.model_config.vocab_size for tokens in batched for t in tokens)
    if cell.exact and cell.weights != "gguf":
        assert batched == references[cell.family]
    if cell.deterministic and not any(name.startswith("deterministic_") for name in logged):
        assert [_generate(llm, [prompt])[0] for prompt in PROMPTS] == batched  # alone as in the batch
    llm.engine.close()


def _expected_refusals(cell: Cell) -> set[str]:
    """The refusals this walk knows of, stated here apart from the table, so that a row lost from it fails here."""
    expected = set()
    if cell.deterministic and cell.speculative:
        expected.add("deterministic_with_speculation")
    if cell.family == "gemma2" and cell.kv in ("int8", "fp8_e4m3"):
        expected.add("eight_bit_kv_with_windows_or_softcaps")
    return expected


def _expected_fallbacks(cell: Cell) -> set[str]:
    expected = set()
    native = kernels.load() is not None
    if cell.kv == _other_float(cell.dtype) and native:  # without them every step takes the torch code anyway
        expected.add("kv_pool_dtype_not_the_models")
    if cell.deterministic and not native:
        expected.add("deterministic_without_native_kernels")
    if cell.deterministic and cell.family == "gemma2":
        expected.add("deterministic_with_windows_or_softcaps")
    return expected


def test_the_walk_covers_each_verdict():
    """The reduced product still holds refused, fallback and plain cells of both families and both paths."""
    assert any(_expected_refusals(c) for c in CELLS) and any(_expected_fallbacks(c) for c in CELLS)
    assert {c.family for c in CELLS} == set(FAMILIES) and {c.attention_path for c in CELLS} == {AUTO, "portable"}
    assert {c.weights for c in CELLS} == {"none", "int8", "int4", "gguf"}
    assert len(CELLS) < 200  # a few seconds of engine time, not minutes
