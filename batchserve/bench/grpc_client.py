"""Drive batchserve's token-level gRPC service (batchserve.v1.Generation, `batchserve serve --grpc-port`) with the
same workload, arrivals and timing rules as http_client.py, so the two front ends compare side by side: streaming
Generate with token-id prompts, greedy, ignore_eos; a delivery is a message that carries tokens."""

from __future__ import annotations

import asyncio
import time

import grpc
from tqdm import tqdm

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import RequestResult
from batchserve.bench.trace import RunTrace
from batchserve.bench.workloads import BenchRequest
from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
from batchserve.entrypoints.grpc.pb import generation_pb2_grpc as pb_grpc


def generate_request(req: BenchRequest) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(tokens=pb.TokenIds(ids=req.prompt_token_ids), sampling=sampling, stream=True)


async def stream_one(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, result: RequestResult, metadata: tuple, timeout_s: float
) -> RequestResult:
    tokens = 0
    try:
        async for reply in stub.Generate(request, metadata=metadata, timeout=timeout_s):
            now = time.monotonic()
            if reply.token_ids:
                tokens += len(reply.token_ids)
                result.record_delivery(now)
            if reply.HasField("usage"):
                result.num_cached_tokens = reply.usage.cached_tokens
                tokens = reply.usage.completion_tokens
        result.end_stream(time.monotonic(), tokens)
    except Exception as exc:  # noqa: BLE001 - a benchmark records the failure and goes on
        result.record_failure(exc)
    return result


async def _run(
    target: str, requests: list[BenchRequest], arrivals: ArrivalProcess, seed: int, label: str, progress: bool,
    timeout_s: float, api_key: str | None,
) -> RunTrace:  # fmt: skip
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        bodies = [generate_request(r) for r in requests]
        offsets = arrivals.offsets(len(requests), seed)
        gate = asyncio.Semaphore(arrivals.max_concurrency or len(requests))
        bar = tqdm(total=len(requests), desc=label, unit="req", disable=not progress, leave=False)
        t0 = time.monotonic()

        async def send(req: BenchRequest, body: pb.GenerateRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            async with gate:
                arrival = max(time.monotonic(), t0 + offset) if arrivals.max_concurrency else t0 + offset
                result = RequestResult(req.request_id, req.prompt_len, 0, arrival, category=req.category)
                await stream_one(stub, body, result, metadata, timeout_s)
            bar.update(1)
            return result

        results = await asyncio.gather(*(send(r, b, o) for r, b, o in zip(requests, bodies, offsets, strict=True)))
        bar.close()
        duration = time.monotonic() - t0
    meta = {"duration_s": duration, "target": f"grpc://{target}", "arrivals": arrivals.describe()}
    return RunTrace(label, t0, 1, [], list(results), meta)


def run_grpc(
    target: str,
    requests: list[BenchRequest],
    arrivals: ArrivalProcess | None = None,
    seed: int = 0,
    label: str = "grpc",
    progress: bool = True,
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> RunTrace:
    """Send the workload to a gRPC target (host:port) and return the trace (requests only, no steps)."""
    return asyncio.run(_run(target, requests, arrivals or ArrivalProcess(), seed, label, progress, timeout_s, api_key))
