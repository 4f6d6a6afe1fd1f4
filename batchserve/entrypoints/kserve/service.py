"""KServe v2 `inference.GRPCInferenceService` with the TensorRT-LLM ensemble's tensors, over the serving layer's
GenerationService. ModelInfer answers once; ModelStreamInfer (decoupled, as the ensemble with streaming) takes any
number of requests on one stream and sends one response per engine step, the last flagged with the parameter
`triton_final_response` as Triton does. Errors of one request on the stream come in-band (`error_message`), as
Triton sends them, and the stream goes on; everywhere else they are the RPC's status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from batchserve.engine.async_engine import RequestStream
from batchserve.entrypoints.grpc.status import abort_rpc, grpc_status, invalid
from batchserve.entrypoints.kserve.model import VERSION, KServeModel
from batchserve.entrypoints.kserve.pb import kserve_pb2 as pb
from batchserve.entrypoints.kserve.pb import kserve_pb2_grpc as pb_grpc
from batchserve.entrypoints.kserve.tensors import Output, add_outputs, decode_inputs
from batchserve.entrypoints.kserve.trtllm import TrtllmRequest, outputs_of, parse_request, responses, submit
from batchserve.serving.generation import GenerationService

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"  # the client wants the final flag in a response of its own
_END = object()


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: GenerationService, model: KServeModel) -> None:
        self.service = service
        self.model = model

    # ------------------------------------------------------------------ health and metadata
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:  # noqa: N802, E501
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:  # noqa: N802, E501
        return pb.ServerReadyResponse(ready=self.service.client.is_running)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:  # noqa: N802, E501
        await self._check_model(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=self.service.client.is_running)

    async def ServerMetadata(  # noqa: N802
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="batchserve", version=self.model.served.version, extensions=["generate"])

    async def ModelMetadata(  # noqa: N802
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        await self._check_model(request.name, request.version, context)
        return self.model.metadata(request.name)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:  # noqa: N802, E501
        await self._check_model(request.name, request.version, context)
        return pb.ModelConfigResponse(config=self.model.config(request.name))

    async def _check_model(self, name: str, version: str, context: grpc.aio.ServicerContext) -> None:
        try:
            self.model.check(name, version)
        except Exception as exc:  # noqa: BLE001 - becomes the RPC's status
            await abort_rpc(context, exc)

    # ------------------------------------------------------------------ inference
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:  # noqa: N802, E501
        streams: list[RequestStream] = []
        try:
            trt = self._parse(request)
            trt.answer_once("ModelStreamInfer (the model is decoupled); ModelInfer answers once")
            streams = await self._submit(request, trt)
            (result,) = await self.service.final_results(streams)
            return _response(request, outputs_of(trt, result, delta=False, prefix=_prefix(trt)))
        except Exception as exc:  # noqa: BLE001 - every failure becomes the RPC's status
            await abort_rpc(context, exc)
        finally:
            self.service.abort_unfinished(streams)

    async def ModelStreamInfer(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        queue: asyncio.Queue[object] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    tasks.add(asyncio.ensure_future(self._stream_one(request, queue)))
                await asyncio.gather(*tasks)
            finally:
                queue.put_nowait(_END)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await queue.get()) is not _END:
                yield item
            reader.result()  # a broken request stream ends the RPC with its error
        finally:  # the caller went away (or the server is stopping): every request still running is aborted
            reader.cancel()
            for task in tasks:
                task.cancel()

    async def _stream_one(self, request: pb.ModelInferRequest, queue: asyncio.Queue[object]) -> None:
        """One request of a stream: its responses (or its error) onto the queue; never raises but CancelledError."""
        streams: list[RequestStream] = []
        empty_final = _bool_param(request, EMPTY_FINAL)
        try:
            trt = self._parse(request)
            streams = await self._submit(request, trt)
            async for outputs, last in responses(self.service, trt, streams):
                queue.put_nowait(_stream_response(request, outputs, final=last and not empty_final))
            if empty_final:
                queue.put_nowait(_stream_response(request, [], final=True))
        except Exception as exc:  # noqa: BLE001 - reported in-band; the stream serves the caller's other requests
            _, message, _ = grpc_status(exc)
            reply = pb.ModelInferResponse(model_name=request.model_name, model_version=VERSION, id=request.id)
            queue.put_nowait(pb.ModelStreamInferResponse(error_message=message, infer_response=reply))
        finally:
            self.service.abort_unfinished(streams)

    def _parse(self, request: pb.ModelInferRequest) -> TrtllmRequest:
        self.model.check(request.model_name, request.model_version)
        tensors = decode_inputs(request)
        values = {name: t.values for name, t in tensors.items()}
        ranks = {name: len(t.shape) for name, t in tensors.items()}
        return parse_request(values, ranks, [o.name for o in request.outputs])

    async def _submit(self, request: pb.ModelInferRequest, trt: TrtllmRequest) -> list[RequestStream]:
        return await submit(self.service, trt, _priority(request))  # the caller's id is echoed, not the engine's


def _prefix(trt: TrtllmRequest) -> str:
    return "" if trt.exclude_input else trt.text


def _priority(request: pb.ModelInferRequest) -> int:
    if "priority" not in request.parameters:
        return 0
    param = request.parameters["priority"]
    which = param.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param"):
        raise invalid("the 'priority' parameter must be an integer", "priority")
    return int(getattr(param, which))


def _bool_param(request: pb.ModelInferRequest, name: str) -> bool:
    return name in request.parameters and request.parameters[name].bool_param


def _response(request: pb.ModelInferRequest, outputs: Sequence[Output]) -> pb.ModelInferResponse:
    reply = pb.ModelInferResponse(model_name=request.model_name, model_version=VERSION, id=request.id)
    add_outputs(reply, outputs)
    return reply


def _stream_response(
    request: pb.ModelInferRequest, outputs: Sequence[Output], final: bool
) -> pb.ModelStreamInferResponse:  # noqa: E501
    reply = _response(request, outputs)
    reply.parameters[FINAL].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=reply)
