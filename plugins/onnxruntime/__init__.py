"""The native sharp::SharpAttention kernel library for ONNX Runtime's CPU execution provider.

`make install` builds it (plugins/onnxruntime/build.py); `library_path()` finds it and `register(options)` adds it
to an `onnxruntime.SessionOptions`, after which ONNX Runtime runs the kernel instead of the file's fallback bodies.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
LIBRARY = _HERE / "libsharp_ort.so"
_FAILURE = _HERE / "BUILD_FAILED.txt"


class NativeOpUnavailable(RuntimeError):
    """The library was not built here; the message says why."""


def library_path() -> str:
    """Path of the built library, or NativeOpUnavailable with the build's reason."""
    if LIBRARY.exists():
        return str(LIBRARY)
    if _FAILURE.exists():
        raise NativeOpUnavailable(f"the native op failed to build: {_FAILURE.read_text().strip()}")
    raise NativeOpUnavailable(f"the native op is not built ({LIBRARY} missing): run `make install`")


def register(options: Any) -> None:
    """Register the kernel library with `options` (onnxruntime.SessionOptions)."""
    options.register_custom_ops_library(library_path())


def choose_library(
    native: bool = True, library: str | None = None, tensorrt_form: bool = False
) -> tuple[str | None, str]:
    """The op library a session should register, and a line saying what runs the attention.

    An explicit `library` (or $SHARP_ORT_OP_LIBRARY) wins; else the built native library when `native` and the file
    is in the standard form (the native kernel does not take the TensorRT form's int32 mask and packed parameters);
    else none (the file's fallback bodies run). A missing native library is not an error here: the line says why it
    is not used, and a file without fallback bodies then fails to load with ONNX Runtime's own message."""
    library = library or os.environ.get("SHARP_ORT_OP_LIBRARY")
    if library:
        return library, f"attention: the sharp::SharpAttention kernels of {library}"
    if not native:
        return None, "attention: the file's fallback bodies (native kernel switched off)"
    if tensorrt_form:
        return (
            None,
            "attention: the file's fallback bodies (a TensorRT-form file; the native kernel takes the standard form)",
        )
    try:
        path = library_path()
    except NativeOpUnavailable as e:
        return None, f"attention: the file's fallback bodies ({e})"
    return path, "attention: the native sharp::SharpAttention kernel"
