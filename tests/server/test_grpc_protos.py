"""The checked-in stubs are what the .proto files compile to (run `python -m batchserve.entrypoints.grpc.codegen`
after editing one), and the KServe messages are wire-compatible with Triton's: every field batchserve declares has
Triton's number and type (tritonclient ships Triton's own descriptors)."""

from __future__ import annotations

import ast
import importlib

import pytest
from google.protobuf import descriptor_pb2

from batchserve.entrypoints.grpc import codegen

pytest.importorskip("grpc_tools")

MODULES = {
    "batchserve/entrypoints/grpc/pb/generation.proto": "batchserve.entrypoints.grpc.pb.generation_pb2",
    "batchserve/entrypoints/kserve/pb/kserve.proto": "batchserve.entrypoints.kserve.pb.kserve_pb2",
}


def _file_proto(descriptor) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    descriptor.CopyToProto(proto)
    return proto


@pytest.mark.parametrize("proto", codegen.PROTOS, ids=lambda p: p.name)
def test_checked_in_stubs_match_the_protos(proto, tmp_path):
    codegen.generate(proto, tmp_path)
    fresh = (tmp_path / proto.with_suffix("")).with_name(proto.stem + "_pb2.py").read_text()
    checked_in = importlib.import_module(MODULES[proto.as_posix()])
    # the serialized descriptor is the whole schema; the version lines around it may differ between grpcio-tools
    start = fresh.index("AddSerializedFile(") + len("AddSerializedFile(")
    serialized = ast.literal_eval(fresh[start : fresh.index("')", start) + 1])  # the bytes literal protoc wrote
    assert descriptor_pb2.FileDescriptorProto.FromString(serialized) == _file_proto(checked_in.DESCRIPTOR), (
        f"{proto} changed: run python -m batchserve.entrypoints.grpc.codegen"
    )


def test_kserve_messages_have_tritons_numbers_and_types():
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from batchserve.entrypoints.kserve.pb import kserve_pb2

    theirs = {m.full_name: m for f in (service_pb2, model_config_pb2) for m in _all_messages(f.DESCRIPTOR)}
    ours = list(_all_messages(kserve_pb2.DESCRIPTOR))
    assert len(ours) > 20
    for message in ours:
        triton_message = theirs[message.full_name]
        for field in message.fields:
            twin = triton_message.fields_by_name[field.name]
            assert (field.number, field.type, field.is_repeated) == (twin.number, twin.type, twin.is_repeated), (
                field.full_name
            )
    service = kserve_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    triton_service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in service.methods:
        twin = triton_service.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            twin.input_type.full_name,
            twin.output_type.full_name,
        )


def _all_messages(file_descriptor):
    stack = list(file_descriptor.message_types_by_name.values())
    while stack:
        message = stack.pop()
        yield message
        stack.extend(message.nested_types)
