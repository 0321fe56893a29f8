"""sharp.v1 — the gRPC API's generated modules (generator_pb2, generator_pb2_grpc), compiled from the .proto
files next to this file when the package is installed (setup.py)."""

from pathlib import Path

_here = Path(__file__).parent
for _proto in _here.glob("*.proto"):  # source checkouts only: wheels carry the generated modules alone
    _generated = _here / f"{_proto.stem}_pb2.py"
    if not _generated.exists() or _generated.stat().st_mtime < _proto.stat().st_mtime:
        raise ImportError(f"{_generated.name} is missing or older than {_proto.name}: run `make install` to compile it")
