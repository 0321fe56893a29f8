"""Which backend serves a model: the path judged by its name before any runtime starts, then the backend's own
module imported — only the one asked for (a server of ONNX files never imports torch). A Hugging Face model
directory (or a GGUF) is, for onnxruntime, exported once, checked, into a cache keyed by its content (`exported`),
and its file served — as `vllm serve DIR` serves a directory; the torch backend reads it as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sharp.models import cache, gguf
from sharp.models.messages import did_you_mean
from sharp.serving.backends.interface import BACKENDS, Backend, BackendError

GENAI_CONFIG = "genai_config.json"  # what marks a sharp-export --genai package directory
READS_MODELS = ("onnxruntime", "torch")  # the backends that take a Hugging Face directory or a GGUF
EXPECTED = {
    "onnxruntime": "an .onnx file from sharp-export (or its --genai package), a GGUF file, or a Hugging Face model"
    " directory",
    "torch": "a model.pt, a Hugging Face model directory or a GGUF file",
    "tensorrt": "an engine from sharp-build-engine",
}


def check_model_path(path: str | Path, backend: str) -> Path:
    """`path` as a file `backend` could serve, judged by its name alone; raises BackendError saying what was found
    and what was expected (before any process or runtime starts)."""
    path = Path(path)
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    try:
        found = gguf.find(path)
        if found is not None:
            gguf.read_header(found)
    except ImportError as e:
        raise BackendError(f"{path}: reading a GGUF file needs gguf ({e}); pip install 'sharp-attention[hf]'") from None
    except gguf.GGUFError as e:
        raise BackendError(str(e)) from None
    if found is not None:
        if backend not in READS_MODELS:
            raise BackendError(f"{path}: a GGUF file; --backend {backend} serves {EXPECTED[backend]} (serve it with"
                               " --backend onnxruntime or torch)")  # fmt: skip
        return found
    if path.is_dir() and (path / GENAI_CONFIG).is_file() and not (path / "config.json").is_file():
        if backend != "onnxruntime":  # sharp-export --genai's package: its model.onnx is a file sharp-export wrote
            raise BackendError(f"{path}: an onnxruntime-genai package; --backend {backend} serves {EXPECTED[backend]}"
                               " (serve the package with --backend onnxruntime)")  # fmt: skip
        path = path / "model.onnx"
        if not path.is_file():
            raise BackendError(f"{path.parent}: an onnxruntime-genai package without model.onnx")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BackendError(f"{path}: a directory without config.json, a .gguf or {GENAI_CONFIG} (expected"
                               f" {EXPECTED[backend]})")  # fmt: skip
        if backend not in READS_MODELS:
            raise BackendError(f"{path}: a Hugging Face model directory; --backend {backend} serves {EXPECTED[backend]}"
                               " (serve the directory with --backend onnxruntime or torch)")  # fmt: skip
        return path
    if not path.is_file():
        raise BackendError(f"{path}: no such file or directory (expected {EXPECTED[backend]}){did_you_mean(path)}")
    if backend == "onnxruntime" and path.suffix == ".pt":
        raise BackendError(f"{path}: a checkpoint; export it with sharp-export, or serve it with --backend torch")
    if backend == "torch" and path.suffix == ".onnx":
        raise BackendError(f"{path}: an ONNX file; --backend torch serves a model.pt checkpoint, serve this file with"
                           " --backend onnxruntime")  # fmt: skip
    return path


def is_model_source(path: Path) -> bool:
    """Whether `path` (as check_model_path returned it) is a Hugging Face directory or a GGUF: onnxruntime serves
    its export, torch reads it as it is."""
    return path.is_dir() or gguf.is_gguf(path)


def needs_export(path: Path, backend: str = "onnxruntime") -> bool:
    """Whether `path` (as check_model_path returned it) is served as its export."""
    return backend == "onnxruntime" and is_model_source(path)


def default_backend(path: str | Path, device: str) -> str:
    """The backend `sharp-serve` picks when none is named: torch for a Hugging Face directory or a GGUF on a CUDA
    device (its paged Triton kernels; onnxruntime's CUDA provider would run the op's dense fallback), onnxruntime
    otherwise."""
    path = Path(path)
    try:
        source = gguf.find(path) is not None or (path.is_dir() and (path / "config.json").is_file())
    except (ImportError, gguf.GGUFError):
        source = False  # check_model_path says why
    return "torch" if device == "cuda" and source else "onnxruntime"


def exported(directory: Path, say=print) -> Path:
    """The ONNX file of the Hugging Face model in `directory` (or of a GGUF file): exported (and checked) by
    sharp-export in its own process the first time — the server's process never imports torch — then found by the
    content. Raises BackendError with sharp-export's own refusal when it cannot be exported."""
    out = cache.root() / "exports" / cache.content_key(directory) / "model.onnx"
    if out.is_file():
        say(f"sharp-serve: {directory} exported before: {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"sharp-serve: exporting {directory} once (checked) into {out}")
    cmd = [sys.executable, "-m", "sharp.exporter.cli", str(directory), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        say(f"  {line}")
    if proc.returncode != 0:  # sharp-export's own one line, its path not said twice
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        why = why.removeprefix("sharp-export: ").removeprefix(f"{directory}: ")
        raise BackendError(f"{directory}: not exported: {why}")
    return out


def load_backend(path: str | Path, backend: str = "onnxruntime", device: str = "cpu", **kw) -> Backend:
    """The backend for `path` (a Hugging Face directory: its exported file); raises BackendError with what was found
    and what was expected."""
    path = check_model_path(path, backend)
    if needs_export(path, backend):
        path = exported(path)
    if backend == "tensorrt":
        from sharp.serving.backends.tensorrt_backend import TensorRTBackend

        return TensorRTBackend(path, device)
    if backend == "onnxruntime":
        from sharp.serving.backends.onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend(path, device, **kw)
    from sharp.serving.backends.torch_backend import TorchBackend

    return TorchBackend(path, device, **kw)
