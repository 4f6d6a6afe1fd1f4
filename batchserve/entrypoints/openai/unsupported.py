"""Endpoints of the OpenAI API, vLLM and llama.cpp that this server does not have, each answered with what it is
and what to use instead, rather than a bare "Not Found".

The answers sit behind every real route: they replace the router's not-found handler, so a route the app registers
(now or later, for a path listed here) always wins. When an endpoint gets built, delete its line below.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from batchserve.entrypoints.openai.errors import APIError

OPENAI, VLLM, LLAMA_CPP = "OpenAI", "vLLM", "llama.cpp"
STATUS = 404  # a client's "not found" class (openai.NotFoundError), and what a probing client falls back on
CODE = "unsupported_endpoint"

TEXT_ROUTES = "/v1/completions and /v1/chat/completions generate text"
NO_POOLING = ("not built: a pooling server (--runner pooling) answers POST /v1/embeddings, /v1/score and /v1/rerank "
              "(docs/embeddings.md)")  # fmt: skip
NO_LORA = ("not built: LoRA adapters are vLLM's routes here: a request's `model` names its adapter, POST "
           "/v1/load_lora_adapter and /v1/unload_lora_adapter change them (docs/lora.md)")  # fmt: skip
NO_RESPONSE_PARTS = ("not built: background responses are refused, so there is nothing to cancel, and a stored response is "
                     "read whole by a GET of its id under /v1/responses")  # fmt: skip
NO_AUDIO = f"audio models are not built: {TEXT_ROUTES}"
NO_IMAGES = f"image models are not built: {TEXT_ROUTES}"
NO_STORED_OBJECTS = ("not built: the server keeps no files, batches or assistants; for offline batches use "
                     "`batchserve generate` or the LLM class (docs/offline.md)")  # fmt: skip
NO_SLOTS = (
    "llama.cpp's slots are not built: /dashboard shows the running and waiting requests live, /metrics counts them"
)


@dataclass(frozen=True)
class UnsupportedEndpoint:
    """`path` (with {name} for a path parameter) from `origin`'s API, `what` it does there, and `instead`."""

    path: str
    origin: str
    what: str
    instead: str
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regex = re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(self.path))
        object.__setattr__(self, "pattern", re.compile(regex + "/?"))

    def message(self, method: str, path: str) -> str:
        return f"{method} {path} is {self.origin}'s {self.what}, which this server does not have: {self.instead}"


def _e(paths: str, origin: str, what: str, instead: str) -> list[UnsupportedEndpoint]:
    return [UnsupportedEndpoint(path, origin, what, instead) for path in paths.split()]


UNSUPPORTED_ENDPOINTS: tuple[UnsupportedEndpoint, ...] = (
    *_e("/v1/responses/{id}/cancel /v1/responses/{id}/input_items", OPENAI, "Responses API", NO_RESPONSE_PARTS),
    *_e("/v1/audio/transcriptions /v1/audio/translations /v1/audio/speech", OPENAI, "audio endpoint", NO_AUDIO),
    *_e("/v1/images/generations /v1/images/edits /v1/images/variations", OPENAI, "image endpoint", NO_IMAGES),
    *_e("/v1/moderations", OPENAI, "moderation endpoint", NO_POOLING),
    *_e("/v1/files /v1/batches /v1/fine_tuning/jobs /v1/assistants /v1/threads /v1/vector_stores", OPENAI,
        "stored-object endpoint", NO_STORED_OBJECTS),
    *_e("/pooling /classify /v1/classify", VLLM, "pooling endpoint", NO_POOLING),
    *_e("/invocations", VLLM, "SageMaker endpoint", f"post to the OpenAI routes directly: {TEXT_ROUTES}"),
    *_e("/sleep /wake_up /is_sleeping", VLLM, "sleep-mode endpoint",
        "not built: the engine holds its weights and KV pool for its whole life"),
    *_e("/reset_prefix_cache", VLLM, "cache endpoint", "not built: the prefix cache evicts least recently used "
        "blocks as the pool needs them (--no-enable-prefix-caching turns it off)"),
    *_e("/start_profile /stop_profile", VLLM, "profiler endpoint",
        "not built: `batchserve profile` times engine steps; /dashboard/data has the last steps' timings"),
    *_e("/server_info /load /get_tokenizer_info", VLLM, "server-state endpoint",
        "GET /v1/models names the model and its max_model_len, GET /version the version, /metrics the effective "
        "configuration (batchserve:engine_config) and the load"),
    *_e("/completion /completions", LLAMA_CPP, "native completion endpoint",
        "use POST /v1/completions with OpenAI's fields (prompt, max_tokens for n_predict, stop, temperature, ...)"),
    *_e("/chat/completions", LLAMA_CPP, "chat endpoint alias", "use POST /v1/chat/completions"),
    *_e("/embedding /embeddings", LLAMA_CPP, "embedding endpoint", "use POST /v1/embeddings on a pooling server "
        "(--runner pooling)"),
    *_e("/reranking /v1/reranking", LLAMA_CPP, "rerank endpoint", "use POST /v1/rerank on a pooling server "
        "(--runner pooling)"),
    *_e("/infill", LLAMA_CPP, "fill-in-the-middle endpoint", f"not built: {TEXT_ROUTES}"),
    *_e("/props", LLAMA_CPP, "server properties endpoint",
        "GET /v1/models names the model, its max_model_len and dtype; GET /version the version"),
    *_e("/slots /slots/{id}", LLAMA_CPP, "slots endpoint", NO_SLOTS),
    *_e("/lora-adapters", LLAMA_CPP, "LoRA adapter endpoint", NO_LORA),
    *_e("/apply-template", LLAMA_CPP, "chat template endpoint",
        "POST /tokenize with messages applies the chat template and returns its tokens; /detokenize gives the text"),
)  # fmt: skip


def unsupported_endpoint(path: str) -> UnsupportedEndpoint | None:
    """The table's entry for a request path, if any."""
    return next((entry for entry in UNSUPPORTED_ENDPOINTS if entry.pattern.fullmatch(path)), None)


def answer_unsupported_endpoints(app: FastAPI) -> None:
    """Requests no route takes, to a path of the table, get its answer; any other unmatched path keeps the
    router's own not-found answer. Real routes are matched first, whenever they were registered."""
    not_found: Callable = app.router.default

    async def unsupported_or_not_found(scope: Scope, receive: Receive, send: Send) -> None:
        entry = unsupported_endpoint(scope["path"]) if scope["type"] == "http" else None
        if entry is None:
            await not_found(scope, receive, send)
            return
        error = APIError(STATUS, entry.message(scope["method"], scope["path"]), type_="not_found_error", code=CODE)
        await error.response()(scope, receive, send)

    app.router.default = unsupported_or_not_found
