"""The native sharp::SharpAttention kernel library for ONNX Runtime's CPU execution provider.

`make install` builds it (plugins/onnxruntime/build.py): on x86-64 a baseline (x86-64-v2), an AVX2 (x86-64-v3) and
an AVX-512 (x86-64-v4) variant. `library_path()` picks the widest this CPU runs and `register(options)` adds it to an
`onnxruntime.SessionOptions`, after which ONNX Runtime runs the kernel instead of the file's fallback bodies.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
LIBRARY = _HERE / "libsharp_ort.so"  # the baseline: x86-64-v2 on x86-64, the compiler's default elsewhere
_VARIANTS = (_HERE / "libsharp_ort.x86-64-v4.so", _HERE / "libsharp_ort.x86-64-v3.so", LIBRARY)  # widest first
_FAILURE = _HERE / "BUILD_FAILED.txt"
# CPU flags (as /proc/cpuinfo names them) each -march level needs beyond the one before
_ISA_FLAGS = {
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
_LEVELS = tuple(_ISA_FLAGS)


class NativeOpUnavailable(RuntimeError):
    """The library was not built here, or cannot run on this CPU; the message says why."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    found = re.search(r"^flags\s*:(.*)$", text, re.M)
    return frozenset(found.group(1).split()) if found else frozenset()


def library_isa(path: str | Path) -> str:
    """The ISA a sharp op library was built for (its SHARP_ISA= string), read from the file without loading it."""
    found = re.search(rb"SHARP_ISA=([\w.-]+)\x00", Path(path).read_bytes())
    return found.group(1).decode() if found else "unknown"


def missing_cpu_flags(isa: str) -> set[str]:
    """The CPU flags a library built for `isa` needs and this CPU lacks (none for ISAs this table does not know:
    another architecture's baseline, or a hand-built -march the user answers for)."""
    if isa not in _ISA_FLAGS:
        return set()
    flags = cpu_flags()
    if not flags:  # unknown CPU: only the baseline is assumed
        return set() if isa == _LEVELS[0] else {f"{isa} (this CPU's flags are unreadable)"}
    needed = set().union(*(_ISA_FLAGS[level] for level in _LEVELS[: _LEVELS.index(isa) + 1]))
    return needed - flags


def check_runs_here(path: str | Path) -> None:
    """NativeOpUnavailable naming what is missing when the library at `path` was built for more than this CPU has."""
    isa = library_isa(path)
    if missing := missing_cpu_flags(isa):
        raise NativeOpUnavailable(
            f"{path} was built for {isa} and this CPU lacks {', '.join(sorted(missing))}: use the baseline "
            f"libsharp_ort.so, or build for this CPU (SHARP_NATIVE_MARCH=native make install)"
        )


def library_path(portable: bool = False) -> str:
    """Path of the widest built library this CPU runs (`portable`: the baseline, e.g. to ship in a package), or
    NativeOpUnavailable with the reason."""
    for path in (LIBRARY,) if portable else _VARIANTS:
        if path.exists() and not missing_cpu_flags(library_isa(path)):
            return str(path)
    if _FAILURE.exists():
        raise NativeOpUnavailable(f"the native op failed to build: {_FAILURE.read_text().strip()}")
    if LIBRARY.exists():
        check_runs_here(LIBRARY)  # built for more than this CPU (SHARP_NATIVE_MARCH elsewhere): say what lacks
    raise NativeOpUnavailable(f"the native op is not built ({LIBRARY} missing): run `make install`")


def register(options: Any) -> None:
    """Register the kernel library with `options` (onnxruntime.SessionOptions)."""
    options.register_custom_ops_library(library_path())


def choose_library(
    native: bool = True, library: str | None = None, tensorrt_form: bool = False, portable: bool = False
) -> tuple[str | None, str]:
    """The op library a session should register, and a line saying what runs the attention.

    An explicit `library` (or $SHARP_ORT_OP_LIBRARY) wins; else the built native library when `native` and the file
    is in the standard form (the native kernel does not take the TensorRT form's int32 mask and packed parameters);
    else none (the file's fallback bodies run). A missing native library is not an error here: the line says why it
    is not used, and a file without fallback bodies then fails to load with ONNX Runtime's own message. An explicit
    library built for more than this CPU has raises NativeOpUnavailable. `portable`: the baseline build (for a
    package that runs elsewhere)."""
    library = library or os.environ.get("SHARP_ORT_OP_LIBRARY")
    if library:
        check_runs_here(library)
        return library, f"attention: the sharp::SharpAttention kernels of {library}"
    if not native:
        return None, "attention: the file's fallback bodies (native kernel switched off)"
    if tensorrt_form:
        return (
            None,
            "attention: the file's fallback bodies (a TensorRT-form file; the native kernel takes the standard form)",
        )
    try:
        path = library_path(portable)
    except NativeOpUnavailable as e:
        return None, f"attention: the file's fallback bodies ({e})"
    return path, f"attention: the native sharp::SharpAttention kernel ({library_isa(path)})"
