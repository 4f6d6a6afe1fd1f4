"""Structured outputs in the worker: compile a request's constraint (xgrammar), keep one grammar matcher per
constrained sequence, fill each step's token masks and advance the matchers by the sampled tokens.

A step's masks depend only on the tokens accepted before it, so the runner starts filling them (start_fill) in a
worker thread when the forward pass starts and takes them (masks) before sampling: xgrammar releases the GIL while it
fills, and the model's kernels while they compute. BATCHSERVE_GRAMMAR_OVERLAP=0 fills them on the step's thread.

xgrammar was chosen over llguidance by per-token mask time on the default model's vocabulary (docs/
structured-outputs.md). Its JSON Schema converter ignores keywords it does not implement, so a schema is first
checked here against the keywords it does implement: an output that ignored part of its schema would not validate.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from batchserve import env
from batchserve.sampling_params import ConstraintKind, InvalidRequestError, StructuredOutputsParams
from batchserve.worker.json_schema_checks import (
    check_schema_keywords,
    parse_schema_text,
)

logger = logging.getLogger(__name__)

COMPILED_GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024  # the worker's compiled grammars kept for reuse


def _choice_grammar(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals (the same escapes)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_constraint(compiler: xgr.GrammarCompiler, constraint: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """The compiled grammar (cached by the compiler); InvalidRequestError naming the constraint's field."""
    try:
        return _compile(compiler, constraint)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{constraint.source}: {exc}", constraint.source) from None
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse errors
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        reason = reason.split("] ", 1)[-1]  # drop xgrammar's "[time] file.cc:line:" prefix
        raise InvalidRequestError(
            f"{constraint.source}: invalid {constraint.kind.value}: {reason}", constraint.source
        ) from None


@dataclass(frozen=True)
class NumberBounds:
    """The most digits a JSON number may have in the grammar, per part (0: unbounded). Without a bound a model that
    loops on a digit fills a number field until max_tokens and the JSON never closes."""

    integer_digits: int = 16
    fraction_digits: int = 16
    exponent_digits: int = 3

    @classmethod
    def from_env(cls) -> NumberBounds:
        return cls(env.json_integer_digits(), env.json_fraction_digits())


# xgrammar's rules for a number of any size (its JSON Schema converter, 0.2.x): the integer part, the fraction, the
# exponent. Schema-specific rules (ranges) are its own and already finite on the fraction side.
_INTEGER_PART_RULES = ("basic_integer", "basic_number_2")  # ... [1-9] [0-9]*
_FRACTION_RULE, _EXPONENT_RULE = "basic_number_3", "basic_number_5"  # ... basic_number_digits{1, -1}


def _bounded_rule(line: str, bounds: NumberBounds) -> str:
    name = line.split(" ::= ", 1)[0]
    if name in _INTEGER_PART_RULES and bounds.integer_digits:
        return line.replace("[1-9] [0-9]*", f"[1-9] [0-9]{{0, {bounds.integer_digits - 1}}}")
    digits = {_FRACTION_RULE: bounds.fraction_digits, _EXPONENT_RULE: bounds.exponent_digits}.get(name)
    if digits:
        return line.replace("basic_number_digits{1, -1}", f"basic_number_digits{{1, {digits}}}")
    return line


def json_grammar(schema: str, bounds: NumberBounds, strict_mode: bool = True) -> str:
    """The EBNF of a JSON Schema (compact JSON, as xgrammar converts it) with its numbers bounded by `bounds`: the
    integer part of an unbounded number and of a one-sided range, its fraction and its exponent."""
    if bounds.integer_digits:
        schema = json.dumps(_close_open_ranges(json.loads(schema), 10**bounds.integer_digits - 1))
    # compact JSON: "any whitespace" lets a small model pad forever and run out of tokens mid-object
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode))
    bounded = "\n".join(_bounded_rule(line, bounds) for line in grammar.splitlines())
    if (
        bounded == grammar
        and "basic_number_digits{1, -1}" in grammar
        and (bounds.fraction_digits or bounds.exponent_digits)
    ):
        logger.warning("xgrammar's number rules changed shape: JSON numbers are not bounded")  # pragma: no cover
    return bounded


def _close_open_ranges(schema: Any, limit: int) -> Any:
    """`schema` with each number or integer range open on one side closed at +-limit (xgrammar bounds the digits of
    a range it knows both ends of)."""
    if isinstance(schema, list):
        return [_close_open_ranges(item, limit) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _close_open_ranges(value, limit) for key, value in schema.items()}
    if closed.get("type") in ("integer", "number"):
        has_low = any(_is_number(closed.get(k)) for k in ("minimum", "exclusiveMinimum"))
        has_high = any(_is_number(closed.get(k)) for k in ("maximum", "exclusiveMaximum"))
        if has_low and not has_high:
            closed["maximum"] = limit
        elif has_high and not has_low:
            closed["minimum"] = -limit
    return closed


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)  # draft 4's exclusiveMinimum is a bool


def _compile(compiler: xgr.GrammarCompiler, constraint: StructuredOutputsParams) -> xgr.CompiledGrammar:
    kind, spec = constraint.kind, constraint.spec
    if kind == ConstraintKind.JSON:
        check_schema_keywords(parse_schema_text(spec))
        return compiler.compile_grammar(json_grammar(spec, NumberBounds.from_env()))
    if kind == ConstraintKind.JSON_OBJECT:
        return compiler.compile_grammar(json_grammar('{"type": "object"}', NumberBounds.from_env(), strict_mode=False))
    if kind == ConstraintKind.REGEX:
        return compiler.compile_regex(spec)
    if kind == ConstraintKind.CHOICE:
        return compiler.compile_grammar(_choice_grammar(json.loads(spec)))
    if kind == ConstraintKind.GRAMMAR:
        return compiler.compile_grammar(spec)
    raise InvalidRequestError(f"unknown constraint kind {kind!r}")


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """The tokenizer's vocabulary as xgrammar reads it (`vocab_size`: the logits' width, which may pad the
    tokenizer's)."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))


def new_compiler(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> xgr.GrammarCompiler:
    """A compiler over the tokenizer's vocabulary. One thread: the engine's CPUs are the model's. Its cache of
    compiled grammars (least recently used first out) is bounded in bytes: one per distinct schema would grow
    for the server's life."""
    info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
    return xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILED_GRAMMAR_CACHE_BYTES)


@dataclass(frozen=True)
class _PendingFill:
    req_ids: tuple[str, ...]  # the rows the bitmask was started for
    bitmask: torch.Tensor  # filled once the future is done
    future: Future[None]


@dataclass
class _Sequence:
    matcher: xgr.GrammarMatcher
    broken: bool = False  # a token the grammar refused was appended (cannot happen through the mask): unconstrained


class StructuredOutputs:
    """The worker's per-sequence grammar state. The compiler is built at the first constrained request (it walks the
    whole vocabulary once), so an engine that never sees one pays nothing."""

    def __init__(
        self, vocab_size: int, eos_token_ids: Sequence[int], tokenizer: Any = None, overlap: bool | None = None
    ) -> None:
        """`overlap`: fill a step's masks in a worker thread during the forward pass (default: the environment's)."""
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self.tokenizer = tokenizer
        self.overlap = env.grammar_mask_overlap() if overlap is None else overlap
        self._compiler: xgr.GrammarCompiler | None = None
        self._sequences: dict[str, _Sequence] = {}
        self._filler: ThreadPoolExecutor | None = None  # one thread, started with the first constrained step
        self._pending: _PendingFill | None = None

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._sequences

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                raise RuntimeError("structured outputs need the engine's tokenizer (StructuredOutputs.tokenizer)")
            self._compiler = new_compiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._compiler

    def add(self, req_id: str, constraint: StructuredOutputsParams, output_token_ids: Iterable[int] = ()) -> None:
        """Start a sequence's matcher; `output_token_ids`: tokens it generated before a recompute preemption."""
        self._settle()
        try:
            matcher = xgr.GrammarMatcher(compile_constraint(self.compiler, constraint))
        except InvalidRequestError as exc:  # front ends refuse these first; the engine loop must not die of one
            logger.error("request %s runs unconstrained: %s", req_id, exc)
            return
        state = self._sequences[req_id] = _Sequence(matcher)
        for token_id in output_token_ids:
            self._accept(req_id, state, token_id)

    def remove(self, req_ids: Iterable[str]) -> None:
        self._settle()
        for req_id in req_ids:
            self._sequences.pop(req_id, None)

    def start_fill(self, req_ids: Sequence[str]) -> None:
        """Start filling the masks of these rows in the worker thread (with overlap on and a constrained row); the
        matchers must not change until masks() takes them."""
        self._settle()
        prepared = self._prepare(req_ids) if self.overlap else None
        if prepared is None:
            return
        if self._filler is None:
            self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchserve-grammar-masks")
        bitmask, rows = prepared
        self._pending = _PendingFill(tuple(req_ids), bitmask, self._filler.submit(self.fill_rows, bitmask, rows))

    def masks(self, req_ids: Sequence[str]) -> torch.Tensor | None:
        """The step's bitmask (as fill_masks): the one start_fill began if it began it for these rows, else filled
        now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.result()
            if pending.req_ids == tuple(req_ids):
                return pending.bitmask
        return self.fill_masks(req_ids)

    def _settle(self) -> None:
        """Wait for a fill nobody took (a step that sampled other rows, or failed), before the matchers change."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.exception()  # waits; its result is stale once the matchers move on

    def close(self) -> None:
        """Stop the worker thread (a later start_fill starts a new one)."""
        self._settle()
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None

    def fill_masks(self, req_ids: Sequence[str]) -> torch.Tensor | None:
        """[len(req_ids), ceil(V / 32)] int32 bitmask of the tokens each row may take next (all bits set for a free
        row); None when no row is constrained, so a free batch skips the step entirely."""
        prepared = self._prepare(req_ids)
        if prepared is None:
            return None
        bitmask, rows = prepared
        self.fill_rows(bitmask, rows)
        return bitmask

    def _prepare(self, req_ids: Sequence[str]) -> tuple[torch.Tensor, list[tuple[int, xgr.GrammarMatcher]]] | None:
        """The step's bitmask, all ones but the rows of finished grammars, and the (row, matcher) pairs left to
        fill; None when no row is constrained. Every torch operator of the fill runs here, on the step's thread."""
        states = [(i, self._sequences.get(r)) for i, r in enumerate(req_ids)]
        states = [(i, s) for i, s in states if s is not None and not s.broken]
        if not states:
            return None
        bitmask = xgr.allocate_token_bitmask(len(req_ids), self.vocab_size)  # all ones: every token allowed
        rows = []
        for i, state in states:
            if state.matcher.is_terminated():
                self._only_eos(bitmask, i)  # the grammar is done: only the end may follow (ignore_eos runs on)
            else:
                rows.append((i, state.matcher))
        return bitmask, rows

    @staticmethod
    def fill_rows(bitmask: torch.Tensor, rows: Sequence[tuple[int, xgr.GrammarMatcher]]) -> None:
        """xgrammar fills each row (writing through DLPack, without the GIL). No torch operator may run here: one
        in the worker thread could start a second OpenMP team, and with more OpenMP threads than cores GNU OpenMP
        makes every team's workers sleep after each region, slowing every operator of the model."""
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, row)

    def _only_eos(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token_id in self.eos_token_ids:
            bit = token_id % 32
            bitmask[row, token_id // 32] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32: bit 31 is the sign

    def accept(self, req_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        self._settle()
        for req_id, token_id in zip(req_ids, token_ids, strict=True):
            state = self._sequences.get(req_id)
            if state is not None:
                self._accept(req_id, state, token_id)

    @staticmethod
    def _accept(req_id: str, state: _Sequence, token_id: int) -> None:
        if state.broken or state.matcher.is_terminated():
            return
        if not state.matcher.accept_token(token_id):
            logger.warning("request %s: token %d is outside its grammar; no longer constrained", req_id, token_id)
            state.broken = True


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """The logits with every token the bitmask forbids at -inf. Out of place unless `in_place` (a copy of a step's
    [N, V] logits is a fresh allocation each step, as costly as the masking itself)."""
    masked = logits if in_place else logits.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device), vocab_size=logits.shape[-1])
    return masked
