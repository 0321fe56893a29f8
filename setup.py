"""Compiles proto/sharp/v1/*.proto with grpcio-tools every time the package is built or installed, so the
generated gRPC modules always match the definitions (nothing generated is committed), and builds the native
sharp::SharpAttention library for ONNX Runtime (plugins/onnxruntime/build.py; when it cannot be built the install
still succeeds and says why once)."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO_ROOT = Path(__file__).resolve().parent / "proto"
NATIVE_BUILD = Path(__file__).resolve().parent / "plugins" / "onnxruntime" / "build.py"


def compile_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    for source in sorted(PROTO_ROOT.glob("sharp/v1/*.proto")):
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={PROTO_ROOT}",
            f"--pyi_out={PROTO_ROOT}",
            f"--grpc_python_out={PROTO_ROOT}",
            str(source.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {source}")


def build_native_op() -> None:
    spec = importlib.util.spec_from_file_location("sharp_native_build", NATIVE_BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build_for_install()


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        compile_protos()
        build_native_op()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
