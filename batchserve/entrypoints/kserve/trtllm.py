"""The TensorRT-LLM ensemble's tensor names over batchserve: its inputs -> the prompt and SamplingParams, and a
step's result -> its output tensors. Protocol-neutral: gRPC ModelInfer/ModelStreamInfer and the HTTP generate
extension both call it, with each input given as a flat list of values (one element for a scalar).

num_return_sequences > 1 runs as the serving layer's n > 1 child requests (one prefill, the prompt's KV blocks
shared). As TensorRT-LLM's decoupled model sends them, each sequence's results are responses of their own, told apart
by a `sequence_index` output; so only the decoupled calls (ModelStreamInfer, generate_stream) take it."""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchserve.engine.async_engine import RequestStream
from batchserve.entrypoints.grpc.status import invalid
from batchserve.entrypoints.kserve.tensors import Output
from batchserve.sampling_params import MAX_N, SamplingParams, check_temperature
from batchserve.serving.errors import ErrorKind, ServingError
from batchserve.serving.fanout import submit_choices
from batchserve.serving.generation import GenerationService
from batchserve.serving.results import GenerationResult
from batchserve.serving.structured import constraint_for


@dataclass(frozen=True)
class Field:
    kind: str  # text, texts, int, real, bool
    datatype: str  # the ensemble's, reported by ModelMetadata and ModelConfig
    required: bool = False


INPUTS: dict[str, Field] = {
    "text_input": Field("text", "BYTES", required=True),
    "max_tokens": Field("int", "INT32", required=True),
    "stream": Field("bool", "BOOL"),
    "temperature": Field("real", "FP32"),
    "top_k": Field("int", "INT32"),
    "top_p": Field("real", "FP32"),
    "repetition_penalty": Field("real", "FP32"),
    "presence_penalty": Field("real", "FP32"),
    "frequency_penalty": Field("real", "FP32"),
    "min_tokens": Field("int", "INT32"),
    "min_length": Field("int", "INT32"),  # the older ensembles' name of min_tokens
    "random_seed": Field("int", "UINT64"),
    "end_id": Field("int", "INT32"),
    "pad_id": Field("int", "INT32"),
    "stop_words": Field("texts", "BYTES"),
    "bad_words": Field("texts", "BYTES"),
    "return_log_probs": Field("bool", "BOOL"),
    "return_num_input_tokens": Field("bool", "BOOL"),
    "return_num_output_tokens": Field("bool", "BOOL"),
    "exclude_input_in_output": Field("bool", "BOOL"),
    "beam_width": Field("int", "INT32"),
    "num_return_sequences": Field("int", "INT32"),
    "length_penalty": Field("real", "FP32"),
    "return_context_logits": Field("bool", "BOOL"),
    "return_generation_logits": Field("bool", "BOOL"),
    "embedding_bias_words": Field("texts", "BYTES"),
    "embedding_bias_weights": Field("reals", "FP32"),
    "guided_decoding_guide_type": Field("text", "BYTES"),
    "guided_decoding_guide": Field("text", "BYTES"),
    # batchserve's own: service-level targets in ms, as the HTTP fields (docs/slo.md)
    "ttft_slo_ms": Field("real", "FP32"),
    "tpot_slo_ms": Field("real", "FP32"),
    # the adapter whose lora_int_id this is (loaded by folder: --lora-modules, /v1/load_lora_adapter; docs/lora.md)
    "lora_task_id": Field("int", "INT32"),
}
# ensemble inputs that need a feature batchserve does not have: refused by name, whatever their value
REFUSED: dict[str, str] = {
    **dict.fromkeys(("prompt_embedding_table", "prompt_vocab_size", "prompt_table_extra_id"), "p-tuning"),
    **dict.fromkeys(
        ("lora_weights", "lora_config"),
        "LoRA weights sent with a request (load the adapter's folder, then name it by lora_task_id)",
    ),
    **dict.fromkeys(("top_p_decay", "top_p_min", "top_p_reset_ids"), "top-p decay"),
    "no_repeat_ngram_size": "n-gram bans",
    "early_stopping": "beam search",
}
# outputs: name -> datatype; text_output always, the others when asked for (or their return_* flag is set)
OUTPUTS: dict[str, str] = {
    "text_output": "BYTES",
    "output_ids": "INT32",
    "sequence_length": "INT32",
    "cum_log_probs": "FP32",
    "output_log_probs": "FP32",
    "num_input_tokens": "INT32",
    "num_output_tokens": "INT32",
    "sequence_index": "INT32",  # which of num_return_sequences a response carries (sent when there are several)
}
LOG_PROB_OUTPUTS = ("cum_log_probs", "output_log_probs")
# TensorRT-LLM's guided_decoding_guide_type -> the structured_outputs field of the same meaning (structural_tag:
# none here); "json" needs no guide: any JSON object
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}


@dataclass(frozen=True)
class TrtllmRequest:
    text: str
    params: SamplingParams
    stream: bool
    exclude_input: bool  # False: text_output starts with the prompt, as older ensembles answered
    outputs: tuple[str, ...]  # the output tensors each response carries
    batched: bool  # text_input came with a batch dimension ([1, 1]): outputs keep one
    lora_task_id: int | None = None  # the adapter's lora_int_id; None: the base model

    @property
    def num_sequences(self) -> int:
        return self.params.n

    def answer_once(self, where: str) -> None:
        """INVALID_ARGUMENT unless a single response can answer it (`where`: the call, and what to use instead)."""
        _refuse_unless(not self.stream, "stream", f"stream=true needs {where}")
        _refuse_unless(
            self.num_sequences == 1, "num_return_sequences",
            f"num_return_sequences > 1 (each sequence a response of its own) needs {where}",
        )  # fmt: skip


def parse_request(
    values: Mapping[str, Sequence[Any]], ranks: Mapping[str, int], requested: Sequence[str]
) -> TrtllmRequest:
    """`values`: each input's flattened elements; `ranks`: their number of dimensions (a JSON scalar is 0);
    `requested`: output names the caller asked for (none: the defaults). INVALID_ARGUMENT names the field."""
    for name in values:
        if name in REFUSED:
            raise invalid(f"input '{name}' is not supported: batchserve has no {REFUSED[name]}", name)
        if name not in INPUTS:
            raise invalid(f"unexpected input '{name}' (TensorRT-LLM ensemble inputs: {', '.join(INPUTS)})", name)
    for name, spec in INPUTS.items():
        if spec.required and name not in values:
            raise invalid(f"input '{name}' is required", name)
    get = _Reader(values)
    _refuse_unless(get.one("beam_width", 1) == 1, "beam_width", "only beam_width 1 is supported (no beam search)")
    _refuse_unless(not get.texts("bad_words"), "bad_words", "bad_words is not supported (no multi-token bans)")
    for name in ("return_context_logits", "return_generation_logits"):
        _refuse_unless(not get.one(name, False), name, f"{name} is not supported (logits are not returned)")
    for name in ("embedding_bias_words", "embedding_bias_weights"):
        _refuse_unless(not get.many(name), name, f"{name} is not supported (no embedding bias)")
    params = _sampling_params(get)
    outputs = _outputs(requested, get, params.n)
    if any(n in LOG_PROB_OUTPUTS for n in outputs) and params.logprobs is None:
        params.logprobs = 0  # the sampled token's logprob only
    return TrtllmRequest(
        text=get.one("text_input"),
        params=params,
        stream=get.one("stream", False),
        exclude_input=get.one("exclude_input_in_output", True),
        outputs=outputs,
        batched=ranks.get("text_input", 0) >= 2,
        lora_task_id=get.one("lora_task_id", None),
    )


def _sampling_params(get: _Reader) -> SamplingParams:
    options: dict[str, Any] = {"max_tokens": get.one("max_tokens"), "stop": [s for s in get.texts("stop_words") if s]}
    top_k, top_p = get.one("top_k", 0), get.one("top_p", 0.0)
    _refuse_unless(top_k >= 0, "top_k", f"top_k must be >= 0 (0: off), got {top_k}")
    _refuse_unless(0.0 <= top_p <= 1.0, "top_p", f"top_p must be in [0, 1] (0: off), got {top_p}")
    if "temperature" in get.values:  # checked even where it is unused: a wrong value is the caller's mistake
        check_temperature(get.one("temperature"))
    if top_k == 0 and top_p == 0:
        options["temperature"] = 0.0  # TensorRT-LLM samples greedily when neither top_k nor top_p is set
    else:
        options["temperature"] = get.one("temperature", 1.0)
        options["top_k"] = max(top_k, 0)
        options["top_p"] = top_p if top_p > 0 else 1.0
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "ttft_slo_ms", "tpot_slo_ms"):
        if name in get.values:
            options[name] = get.one(name)
    min_tokens = get.one("min_tokens", get.one("min_length", 0))
    options["min_tokens"] = min_tokens
    if "random_seed" in get.values:
        options["seed"] = get.one("random_seed")
    end_id = get.one("end_id", None)
    if end_id is not None:  # it replaces the model's EOS; -1: never stop early (benchmarks use it)
        _refuse_unless(end_id >= -1, "end_id", f"end_id must be a token id or -1 (never stop early), got {end_id}")
        options["ignore_eos"] = True
        options["stop_token_ids"] = [end_id] if end_id >= 0 else []
    if get.one("return_log_probs", False):
        options["logprobs"] = 0
    options["n"] = get.one("num_return_sequences", 1)
    _refuse_unless(
        1 <= options["n"] <= MAX_N, "num_return_sequences",
        f"num_return_sequences must be between 1 and {MAX_N}, got {options['n']}",
    )  # fmt: skip
    options["structured_outputs"] = _guide(get)
    return SamplingParams(**options)


def _guide(get: _Reader):
    kind, guide = get.one("guided_decoding_guide_type", None), get.one("guided_decoding_guide", None)
    if kind is None:
        _refuse_unless(guide is None, "guided_decoding_guide", "guided_decoding_guide needs guided_decoding_guide_type")
        return None
    _refuse_unless(
        kind in GUIDE_TYPES, "guided_decoding_guide_type",
        f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, got {kind!r}",
    )  # fmt: skip
    if GUIDE_TYPES[kind] == "json_object":
        return constraint_for("json_object", "", "guided_decoding_guide_type")
    _refuse_unless(
        bool(guide), "guided_decoding_guide", f"guided_decoding_guide_type {kind} needs guided_decoding_guide"
    )
    return constraint_for(GUIDE_TYPES[kind], guide, "guided_decoding_guide")


def _outputs(requested: Sequence[str], get: _Reader, num_sequences: int) -> tuple[str, ...]:
    for name in requested:
        if name not in OUTPUTS:
            raise invalid(f"unexpected output '{name}' (outputs: {', '.join(OUTPUTS)})", "outputs")
    if requested:
        return tuple(dict.fromkeys(requested))
    names = ["text_output"]
    if get.one("return_log_probs", False):
        names += LOG_PROB_OUTPUTS
    names += [n for n in ("num_input_tokens", "num_output_tokens") if get.one(f"return_{n}", False)]
    if num_sequences > 1:
        names.append("sequence_index")
    return tuple(names)


def _refuse_unless(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise invalid(message, name)


class _Reader:
    """Typed access to the inputs: scalars hold exactly one element (one request per call: batch size 1)."""

    def __init__(self, values: Mapping[str, Sequence[Any]]) -> None:
        self.values = values

    def one(self, name: str, default: Any = ...) -> Any:
        if name not in self.values:
            return default
        elements = self.values[name]
        if len(elements) != 1:
            raise invalid(f"input '{name}' must hold one value (batch size 1 per request), got {len(elements)}", name)
        return _typed(name, INPUTS[name].kind, elements[0])

    def many(self, name: str) -> list[Any]:
        return [_typed(name, INPUTS[name].kind, v) for v in self.values.get(name, [])]

    def texts(self, name: str) -> list[str]:
        return [s for s in self.many(name) if s]  # ensembles send [""] for "none"


def _typed(name: str, kind: str, value: Any) -> Any:
    ok = {
        "text": isinstance(value, str),
        "texts": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
    }.get(kind, isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value))
    if not ok:
        wanted = {"text": "text", "texts": "text", "int": "an integer", "bool": "a boolean"}.get(
            kind, "a finite number"
        )
        raise invalid(f"input '{name}' must be {wanted}, got {value!r}", name)
    return value


def outputs_of(request: TrtllmRequest, result: GenerationResult, delta: bool, prefix: str = "") -> list[Output]:
    """The response tensors for one step's result (delta: this step's tokens) or the whole output; `prefix` is put
    before the text (the prompt, when exclude_input_in_output is false)."""
    step, whole = result.delta, result.completion
    ids = step.delta_token_ids if delta else whole.token_ids
    text = prefix + (step.delta_text if delta else whole.text)
    logprobs = result.delta_logprobs if delta else (whole.logprobs or [])
    lead = (1,) if request.batched else ()
    values: dict[str, tuple[tuple[int, ...], list[Any]]] = {
        "text_output": ((*lead, 1), [text]),
        "output_ids": ((*lead, 1, len(ids)), list(ids)),
        "sequence_length": ((*lead, 1), [len(ids)]),
        "cum_log_probs": ((*lead, 1), [whole.cumulative_logprob]),
        "output_log_probs": ((*lead, 1, len(logprobs)), [e.logprob for e in logprobs]),
        "num_input_tokens": ((*lead, 1), [step.num_prompt_tokens]),
        "num_output_tokens": ((*lead, 1), [step.num_output_tokens]),
        "sequence_index": ((*lead, 1), [result.index]),
    }
    return [Output(name, OUTPUTS[name], *values[name]) for name in request.outputs]


async def submit(service: GenerationService, request: TrtllmRequest, priority: int) -> list[RequestStream]:
    """The request's engine streams: one, or one per sequence (choice order) sharing the prompt's prefill. The
    caller's id is never the engine's: Triton clients reuse ids ("1") freely."""
    params = request.params
    if request.lora_task_id is not None:
        params = dataclasses.replace(params, lora_name=_adapter_of(service, request.lora_task_id))
    return await submit_choices(service, f"kserve-{uuid.uuid4().hex}", [request.text], params, priority)


def _adapter_of(service: GenerationService, task_id: int) -> str:
    listed = getattr(service.client, "list_loras", None)
    names = {lora.lora_int_id: lora.lora_name for lora in (listed() if listed is not None else ())}
    if task_id not in names:
        raise ServingError(ErrorKind.NOT_FOUND, f"lora_task_id {task_id}: no LoRA adapter of that id is served",
                           "lora_task_id")  # fmt: skip
    return names[task_id]


async def responses(
    service: GenerationService, request: TrtllmRequest, streams: Sequence[RequestStream]
) -> AsyncIterator[tuple[list[Output], bool]]:
    """A decoupled call's responses as (outputs, last): streaming, one per sequence per step with new tokens (or its
    end); otherwise one per sequence, when it ends. Each sequence's first text starts with the prompt when
    exclude_input_in_output is false."""
    unprefixed = set(range(len(streams))) if not request.exclude_input else set()
    running = len(streams)
    async for result in service.results(streams):
        running -= result.finished
        if request.stream and (result.delta.delta_token_ids or result.finished) or result.finished:
            prefix = request.text if result.index in unprefixed else ""
            unprefixed.discard(result.index)
            yield outputs_of(request, result, delta=request.stream, prefix=prefix), running == 0
