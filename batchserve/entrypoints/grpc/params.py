"""batchserve.v1 request messages -> the engine's inputs: the prompt (text tokenized off the event loop, or token
ids) and SamplingParams, every field the engine has. Values are checked by SamplingParams and the serving layer's
request builder, as the HTTP server's are, so both front ends refuse the same input with the same message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
from batchserve.entrypoints.grpc.status import invalid
from batchserve.sampling_params import SamplingParams
from batchserve.serving.generation import GenerationService
from batchserve.serving.structured import constraint_for

# optional scalar fields copied as they are when set; unset ones keep SamplingParams' defaults
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "logprobs", "skip_special_tokens", "n", "ttft_slo_ms", "tpot_slo_ms",
             "deadline")  # fmt: skip


@dataclass(frozen=True)
class PreparedInput:
    token_ids: list[int]  # unchecked: the request builder checks them
    text: str | None  # the text they came from, if any
    param: str  # the field they came from, named in an error about them


async def prepare_input(service: GenerationService, request: pb.GenerateRequest) -> PreparedInput:
    which = request.WhichOneof("input")
    if which == "text":
        if not request.text:
            raise invalid("the prompt is empty", "text")
        return PreparedInput(await service.tokenize(request.text), request.text, "prompt")
    if which == "tokens":
        return PreparedInput(list(request.tokens.ids), None, "tokens")
    raise invalid("give the prompt as 'text' or 'tokens'", "input")


def sampling_params(message: pb.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """Raises InvalidRequestError (naming the field) for values the engine cannot serve."""
    options: dict[str, Any] = {
        "max_tokens": message.max_tokens if message.HasField("max_tokens") else default_max_tokens,
        "stop": list(message.stop),
        "stop_token_ids": list(message.stop_token_ids),
        "ignore_eos": message.ignore_eos,
        "min_tokens": message.min_tokens,
        "include_stop_str_in_output": message.include_stop_str_in_output,
    }
    options.update({name: getattr(message, name) for name in _OPTIONAL if message.HasField(name)})
    if message.logit_bias:  # only when given: the engine's other callers need not know the field
        options["logit_bias"] = dict(message.logit_bias)
    options["structured_outputs"] = _constraint(message)
    if message.HasField("kv_retention"):
        options["kv_retention"] = _retention(message.kv_retention)
    return SamplingParams(**options)


def _retention(message: pb.KVRetention) -> dict[str, Any]:
    """As the HTTP server's kv_retention object: SamplingParams checks both alike."""
    ranges = [
        {"token_start": r.token_start, "priority": r.priority}
        | ({"token_end": r.token_end} if r.HasField("token_end") else {})
        | ({"duration_s": r.duration_s} if r.HasField("duration_s") else {})
        for r in message.token_ranges
    ]
    value: dict[str, Any] = {"token_ranges": ranges}
    for name in ("decode_priority", "decode_duration_s"):
        if message.HasField(name):
            value[name] = getattr(message, name)
    return value


def _constraint(message: pb.SamplingParams):
    """The oneof `constraint` as the HTTP server's guided_* field of the same kind (same checks, same errors)."""
    which = message.WhichOneof("constraint")
    if which is None or (which == "json_object" and not message.json_object):
        return None
    value = list(message.choice.values) if which == "choice" else getattr(message, which)
    return constraint_for("json" if which == "json_schema" else which, value, f"sampling.{which}")
