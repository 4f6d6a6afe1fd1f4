"""The model as KServe v2 callers see it: the names it answers to (the served names, and `ensemble`, the name
TensorRT-LLM deployments give the model clients call, so their scripts work unchanged), its version, and its
metadata and configuration (the TensorRT-LLM ensemble's tensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchserve.entrypoints.grpc.served import ServedModel
from batchserve.entrypoints.grpc.status import not_found
from batchserve.entrypoints.kserve.pb import kserve_pb2 as pb
from batchserve.entrypoints.kserve.trtllm import INPUTS, OUTPUTS

TRTLLM_MODEL_NAME = "ensemble"
VERSION = "1"
PLATFORM = "batchserve"
MAX_BATCH_SIZE = 1  # one prompt per inference request; the engine batches requests with each other
_CONFIG_TYPES = {"BYTES": pb.TYPE_STRING, "BOOL": pb.TYPE_BOOL, "INT32": pb.TYPE_INT32, "UINT64": pb.TYPE_UINT64,
                 "FP32": pb.TYPE_FP32}  # fmt: skip


@dataclass(frozen=True)
class KServeModel:
    served: ServedModel

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.served.names, TRTLLM_MODEL_NAME)))

    def check(self, name: str, version: str = "") -> None:
        """NOT_FOUND for a model or version this server does not serve."""
        if name not in self.names:
            raise not_found(f"unknown model '{name}': this server serves {', '.join(repr(n) for n in self.names)}")
        if version not in ("", VERSION):
            raise not_found(f"unknown version '{version}' of model '{name}': only version {VERSION} is served")

    def metadata(self, name: str) -> pb.ModelMetadataResponse:
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=name,
            versions=[VERSION],
            platform=PLATFORM,
            inputs=[tensor(name=n, datatype=f.datatype, shape=[-1, -1]) for n, f in INPUTS.items()],
            outputs=[tensor(name=n, datatype=t, shape=[-1, -1]) for n, t in OUTPUTS.items()],
        )

    def config(self, name: str) -> pb.ModelConfig:
        return pb.ModelConfig(
            name=name,
            platform=PLATFORM,
            backend=PLATFORM,
            max_batch_size=MAX_BATCH_SIZE,
            input=[
                pb.ModelInput(name=n, data_type=_CONFIG_TYPES[f.datatype], dims=[-1], optional=not f.required)
                for n, f in INPUTS.items()
            ],  # fmt: skip
            output=[pb.ModelOutput(name=n, data_type=_CONFIG_TYPES[t], dims=[-1]) for n, t in OUTPUTS.items()],
            model_transaction_policy=pb.ModelTransactionPolicy(decoupled=True),  # streams one response per step
        )

    def metadata_json(self, name: str) -> dict[str, Any]:
        """The HTTP form of `metadata` (GET /v2/models/{name})."""
        reply = self.metadata(name)
        tensors = lambda ts: [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in ts]  # noqa: E731
        return {"name": name, "versions": [VERSION], "platform": PLATFORM, "inputs": tensors(reply.inputs),
                "outputs": tensors(reply.outputs)}  # fmt: skip
