"""batchserve.v1.Generation: the token-level service for routers and gateways (Generate, Abort, ModelInfo,
ServerInfo), over the serving layer's GenerationService as the OpenAI routes are."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator

import grpc

from batchserve.core.outputs import Logprobs
from batchserve.engine.async_engine import EngineDeadError, RequestStream
from batchserve.entrypoints.grpc.params import prepare_input, sampling_params
from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
from batchserve.entrypoints.grpc.pb import generation_pb2_grpc as pb_grpc
from batchserve.entrypoints.grpc.served import ServedModel
from batchserve.entrypoints.grpc.status import abort_rpc, invalid
from batchserve.serving.fanout import submit_choices
from batchserve.serving.generation import GenerationService
from batchserve.serving.results import GenerationResult, Usage


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, service: GenerationService, served: ServedModel) -> None:
        self.service = service
        self.served = served
        # Generate's requests in flight, by id: what Abort may end (their choices' streams; None: the id is claimed,
        # the request not admitted)
        self._live: dict[str, list[RequestStream] | None] = {}
        self._aborted: set[str] = set()  # ended by Abort: their streams close with finish_reason "abort"

    async def Generate(  # noqa: N802 - the RPC's name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        last: GenerationResult | None = None
        owner = False  # whether this call claimed request_id: only the owner may let it go
        try:
            try:
                prepared = await prepare_input(self.service, request)
                default_max = self.service.limits.default_max_tokens(len(prepared.token_ids))
                params = sampling_params(request.sampling, default_max)
                if request.lora_name:  # an adapter the engine does not serve: NOT_FOUND, naming it
                    params = dataclasses.replace(params, lora_name=request.lora_name)
                if request_id in self._live:
                    raise invalid(f"request id {request_id!r} is already in use", "request_id")
                self._live[request_id], owner = None, True  # claimed with no await since the check
                streams = await self._admit(request_id, prepared, params, request.priority)
                self._live[request_id] = streams
                if request.stream:
                    async for last in self.service.results(streams):
                        if last.delta.delta_token_ids or last.finished:
                            yield _response(request_id, last, request.return_text, delta=True)
                else:
                    for last in await self.service.final_results(streams):
                        yield _response(request_id, last, request.return_text, delta=False)
            except EngineDeadError:
                if request_id not in self._aborted:
                    raise
                yield _aborted(request_id, last)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the RPC's status
            await abort_rpc(context, exc)
        finally:  # done, failed, or cancelled by the caller (CancelledError): the engine lets go at its next step
            if owner:  # a refused duplicate must not remove the running request's entry
                self._live.pop(request_id, None)
                self._aborted.discard(request_id)
            self.service.abort_unfinished(streams)

    async def _admit(self, request_id: str, prepared, params, priority: int) -> list[RequestStream]:
        """One engine request, or n choices (ids request_id-0-i) that share the prompt's prefill."""
        if params.n > 1:
            return await submit_choices(self.service, request_id, [prepared.token_ids], params, priority)
        built = self.service.requests.build(
            request_id, prepared.token_ids, params, priority, prompt=prepared.text, param=prepared.param
        )
        return await self.service.admit([built])

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        ids = [rid for rid in dict.fromkeys(request.request_ids) if self._live.get(rid) is not None]
        self._aborted.update(ids)
        self.service.client.abort([s.request_id for rid in ids for s in self._live[rid]])
        return pb.AbortResponse(aborted_ids=ids)

    async def ModelInfo(  # noqa: N802
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        limits, config = self.service.limits, self.service.client.config
        block_size = config.cache.block_size
        eos = self.service.tokenizer.eos_token_id
        return pb.ModelInfoResponse(
            model_name=self.served.name,
            served_model_names=list(self.served.names),
            max_model_len=limits.max_model_len,
            max_input_len=limits.max_input_len,
            vocab_size=limits.vocab_size,
            block_size=block_size,
            num_kv_blocks=limits.kv_capacity_tokens // block_size,
            max_batch_size=config.scheduler.max_batch_size,
            max_num_tokens=config.scheduler.max_num_tokens,
            max_waiting_requests=config.scheduler.max_waiting_requests or 0,
            eos_token_ids=[eos] if eos is not None else [],
            truncation=str(limits.truncation),
            max_request_bytes=self.served.max_request_bytes,
        )

    async def ServerInfo(  # noqa: N802
        self, request: pb.ServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfoResponse:
        client = self.service.client
        reply = pb.ServerInfoResponse(
            uptime_s=self.served.uptime_s(), engine_running=client.is_running, version=self.served.version
        )
        stats = client.stats()
        if stats is not None:  # none before the first step
            reply.num_running, reply.num_waiting, reply.num_swapped = (
                stats.num_running, stats.num_waiting, stats.num_swapped,
            )  # fmt: skip
            reply.kv_cache_usage = stats.kv_usage
            reply.kv_blocks_used, reply.kv_blocks_total = stats.kv_blocks_used, stats.kv_blocks_total
            queries = stats.prefix_cache_queries
            reply.prefix_cache_hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
        return reply


def _response(request_id: str, result: GenerationResult, return_text: bool, delta: bool) -> pb.GenerateResponse:
    """One message: this step's tokens (delta) or all of them, with the finish fields once the request is done."""
    step, whole = result.delta, result.completion
    reply = pb.GenerateResponse(
        request_id=request_id,
        index=result.index,
        token_ids=step.delta_token_ids if delta else whole.token_ids,
        logprobs=[_logprob(e) for e in (result.delta_logprobs if delta else whole.logprobs or [])],
    )
    if return_text:
        reply.text = step.delta_text if delta else whole.text
    if result.finished:
        reply.finish_reason = result.finish_reason or ""
        if isinstance(result.stop_reason, str):
            reply.stop_string = result.stop_reason
        elif isinstance(result.stop_reason, int):
            reply.stop_token_id = result.stop_reason
        reply.usage.CopyFrom(_usage(Usage.of([result])))
    return reply


def _aborted(request_id: str, last: GenerationResult | None) -> pb.GenerateResponse:
    """The final message of a request ended by Abort: no new tokens, the usage so far."""
    reply = pb.GenerateResponse(request_id=request_id, finish_reason="abort")
    if last is not None:
        reply.usage.CopyFrom(_usage(Usage.of([last])))
    return reply


def _usage(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens
    )


def _logprob(entry: Logprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        rank=entry.rank,
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top.items()],
    )
