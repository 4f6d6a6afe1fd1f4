"""Which requests a runner serves (docs/embeddings.md): a generation runner refuses pooling requests, a pooling
runner the task its model does not compute, and generation where its model has no LM head; each refusal says which
server to run instead."""

from __future__ import annotations

from batchserve.config import Convert, EngineConfig, Runner
from batchserve.sampling_params import InvalidRequestError, SamplingParams

ENDPOINTS = {Convert.EMBED: "/v1/embeddings", Convert.CLASSIFY: "/v1/score and /v1/rerank"}


def check_runner_task(config: EngineConfig, params: SamplingParams, generates: bool) -> None:
    """InvalidRequestError unless this engine's runner serves the request; `generates`: a pooling runner's model has
    its LM head, so generation requests may share its steps."""
    pooling = params.pooling
    if config.runner != Runner.POOLING:
        if pooling is not None:
            model = config.model or "MODEL"
            raise InvalidRequestError(
                f"this server runs its model for generation (--runner generate): pooling requests ({pooling.task}) "
                f"need a pooling server: batchserve serve {model} --runner pooling",
                "model",
            )
        return
    if pooling is None:
        if not generates:
            raise InvalidRequestError(
                f"this server runs a pooling model ({config.convert}) without an LM head: it serves "
                f"{ENDPOINTS[Convert(config.convert)]}, not generation (run a model with its LM head with --runner "
                "generate)",
                "model",
            )
        return
    if pooling.task != config.convert:
        raise InvalidRequestError(
            f"this server's model computes {config.convert} (--convert {config.convert}), not {pooling.task}: it "
            f"serves {ENDPOINTS[Convert(config.convert)]}",
            "model",
        )
