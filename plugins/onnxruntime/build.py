"""Builds the native sharp::SharpAttention library (sharp_attention.cc) next to this file.

Standard library only: setup.py runs it while the package is built, before torch or onnxruntime exist there.
Headers: ONNX Runtime's C/C++ API from $ORT_INCLUDE_DIR and Eigen from $EIGEN_INCLUDE_DIR, else both from
Debian trixie's header-only packages (libonnxruntime-dev, libeigen3-dev), downloaded with a private apt state
into build/native-deps/ and unpacked there — nothing is installed system-wide. The library calls
GetApi(ORT_API_VERSION) and links nothing of ONNX Runtime.

Portable by default: on x86-64 three variants, `libsharp_ort.so` for the x86-64-v2 baseline (any x86-64 CPU since
about 2009), `libsharp_ort.x86-64-v3.so` (AVX2, FMA) and `libsharp_ort.x86-64-v4.so` (AVX-512: Eigen's GEMMs and
exp/log on 16-float packets), and `library_path()` loads the widest this CPU runs; on other architectures one
library for the compiler's default target. Each records its ISA in a `SHARP_ISA=` string
(read from the file, never by loading it). $SHARP_NATIVE_MARCH builds only `libsharp_ort.so`, for that -march
(e.g. native: fastest, but only for CPUs like the building one).

    python plugins/onnxruntime/build.py [--sanitize] [--output PATH] [--march MARCH]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "sharp_attention.cc", HERE / "norm_table.h", HERE / "block_offsets.h")
LIBRARY = HERE / "libsharp_ort.so"
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
BASELINE = "x86-64-v2" if X86_64 else ""  # "": the compiler's default target (other architectures)
# -march → the library built for it, narrowest first; library_path() loads the widest this CPU can run
VARIANTS = (
    {
        "x86-64-v2": LIBRARY,
        "x86-64-v3": HERE / "libsharp_ort.x86-64-v3.so",
        "x86-64-v4": HERE / "libsharp_ort.x86-64-v4.so",
    }
    if X86_64
    else {"": LIBRARY}
)
FAILURE = HERE / "BUILD_FAILED.txt"  # why the last build failed; library_path() reports it
DEPS = HERE.parents[1] / "build" / "native-deps"
PACKAGES = ("libonnxruntime-dev", "libeigen3-dev")
APT_SOURCE = "deb http://deb.debian.org/debian trixie main"


class BuildError(RuntimeError):
    pass


def _run(cmd: list[str], **kw) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
        raise BuildError(f"{' '.join(cmd[:3])} … failed:\n" + "\n".join(tail))


def _fetch_debian_headers() -> Path:
    """Download and unpack the header packages into DEPS (once); returns the unpacked root."""
    root = DEPS / "root"
    if (root / "usr/include/onnxruntime/onnxruntime_cxx_api.h").exists() and (root / "usr/include/eigen3").exists():
        return root
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise BuildError("no ORT_INCLUDE_DIR/EIGEN_INCLUDE_DIR given and no apt-get/dpkg-deb to fetch the headers")
    state = DEPS / "apt"
    for sub in ("lists/partial", "cache/archives/partial", "etc"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "etc/sources.list").write_text(APT_SOURCE + "\n")
    opts = [
        f"-oDir::State={state}",
        f"-oDir::State::Lists={state}/lists",
        f"-oDir::Cache={state}/cache",
        f"-oDir::Etc::SourceList={state}/etc/sources.list",
        "-oDir::Etc::SourceParts=/dev/null",
        "-oDebug::NoLocking=1",
        "-oAPT::Sandbox::User=root",
        "-q",
    ]
    _run(["apt-get", *opts, "update"])
    with tempfile.TemporaryDirectory() as tmp:
        _run(["apt-get", *opts, "download", *PACKAGES], cwd=tmp)
        for deb in sorted(Path(tmp).glob("*.deb")):
            _run(["dpkg-deb", "-x", str(deb), str(root)])
    return root


def include_dirs() -> list[Path]:
    ort, eigen = os.environ.get("ORT_INCLUDE_DIR"), os.environ.get("EIGEN_INCLUDE_DIR")
    if not (ort and eigen):
        root = _fetch_debian_headers()
        ort = ort or str(root / "usr/include/onnxruntime")
        eigen = eigen or str(root / "usr/include/eigen3")
    dirs = [Path(ort), Path(eigen)]
    if not (dirs[0] / "onnxruntime_cxx_api.h").exists():
        raise BuildError(f"no onnxruntime_cxx_api.h in {dirs[0]}")
    if not (dirs[1] / "Eigen/Core").exists():
        raise BuildError(f"no Eigen/Core in {dirs[1]}")
    return dirs


def up_to_date(output: Path) -> bool:
    return output.exists() and all(output.stat().st_mtime >= s.stat().st_mtime for s in SOURCES)


def build(output: Path = LIBRARY, sanitize: bool = False, march: str | None = None) -> Path:
    """Compile the library to `output` (atomically) for `march` (default: $SHARP_NATIVE_MARCH, else the baseline);
    raises BuildError with the reason."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler ({cxx}) on PATH")
    march = march if march is not None else os.environ.get("SHARP_NATIVE_MARCH", BASELINE)
    isa = march or platform.machine()
    flags = [
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        "-DEIGEN_DONT_PARALLELIZE",
        f'-DSHARP_ISA="{isa}"',
    ]
    flags += [f"-march={march}"] if march else []
    flags += ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer"] if sanitize else ["-O3"]
    includes = [f"-I{d}" for d in (HERE, *include_dirs())]
    tmp = output.with_name(output.name + ".tmp")
    _run([cxx, *flags, *includes, str(SOURCES[0]), "-o", str(tmp)])
    tmp.replace(output)
    return output


def build_for_install() -> None:
    """What setup.py calls: build every variant (or keep the up-to-date ones; only libsharp_ort.so when
    $SHARP_NATIVE_MARCH is set); on failure record why and say so once."""
    variants = {os.environ["SHARP_NATIVE_MARCH"]: LIBRARY} if os.environ.get("SHARP_NATIVE_MARCH") else VARIANTS
    for path in set(VARIANTS.values()) - set(variants.values()):
        path.unlink(missing_ok=True)  # a variant of another build must not be picked over this one
    try:
        for march, path in variants.items():
            if not up_to_date(path):
                build(path, march=march)
        FAILURE.unlink(missing_ok=True)
    except (BuildError, OSError) as e:
        FAILURE.write_text(str(e) + "\n")
        print(f"sharp: the native ONNX Runtime op is unavailable (fallback bodies still run): {e}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanitize", action="store_true", help="AddressSanitizer + UBSan build (for testing)")
    parser.add_argument("--output", type=Path, default=LIBRARY)
    parser.add_argument(
        "--march", help=f"-march to build for (default: $SHARP_NATIVE_MARCH, else {BASELINE or 'none'})"
    )
    args = parser.parse_args()
    try:
        print(build(args.output, args.sanitize, args.march))
    except BuildError as e:
        sys.exit(f"build failed: {e}")


if __name__ == "__main__":
    main()
