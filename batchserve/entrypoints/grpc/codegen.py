"""Regenerates the checked-in gRPC stubs from the .proto files: `python -m batchserve.entrypoints.grpc.codegen`.

The stubs are checked in (not generated at build time) so that installing batchserve needs no protoc and no
grpcio-tools (they are in the dev extra only), and an editable install, a wheel and a plain checkout all import the
same code. tests/server/test_grpc_protos.py fails when a .proto was edited without running this.

The KServe messages are generated into a private descriptor pool instead of protobuf's default one: tritonclient
registers the same `inference.*` names in the default pool, and both must live in one process (a test client next
to the server, or an application embedding both)."""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the folder holding batchserve/: proto paths start there
PROTOS = [
    Path("batchserve/entrypoints/grpc/pb/generation.proto"),
    Path("batchserve/entrypoints/kserve/pb/kserve.proto"),
]
PRIVATE_POOL = {Path("batchserve/entrypoints/kserve/pb/kserve.proto")}
DEFAULT_POOL_CALL = "_descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL_CALL = "_descriptor_pool.DescriptorPool().AddSerializedFile("


def generate(proto: Path, out_dir: Path = PACKAGE_ROOT) -> list[Path]:
    """Writes <name>_pb2.py, <name>_pb2.pyi and <name>_pb2_grpc.py for `proto` under out_dir; returns them."""
    from grpc_tools import protoc  # dev extra: only needed here

    args = [
        "protoc",
        f"-I{PACKAGE_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PACKAGE_ROOT / proto),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto}")
    stem = out_dir / proto.with_suffix("")
    files = [stem.with_name(stem.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    if proto in PRIVATE_POOL:
        module = files[0]
        source = module.read_text()
        if DEFAULT_POOL_CALL not in source:
            raise RuntimeError(f"{module}: protoc's output changed shape; cannot move it to a private pool")
        module.write_text(source.replace(DEFAULT_POOL_CALL, PRIVATE_POOL_CALL))
    return files


def main() -> int:
    for proto in PROTOS:
        for path in generate(proto):
            print(f"wrote {path.relative_to(PACKAGE_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
