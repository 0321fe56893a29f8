"""Compiles proto/sharp/v1/*.proto with grpcio-tools every time the package is built or installed, so the
generated gRPC modules always match the definitions (nothing generated is committed), and builds the native
sharp::SharpAttention library for ONNX Runtime (plugins/onnxruntime/build.py; when it cannot be built the install
still succeeds and says why once). The wheel carries that compiled library, so it is tagged for the platform that
built it (py3-none-linux_x86_64, say), not py3-none-any."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
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


class PlatformWheel(bdist_wheel):
    """Pure Python plus a native library: any Python 3, no ABI, this platform."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(cmdclass={"build_py": BuildPyWithProtos, "bdist_wheel": PlatformWheel})
