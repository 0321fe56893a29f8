"""Which backend serves a model file: the file judged by its name before any runtime starts, then the backend's
own module imported — only the one asked for (a server of ONNX files never imports torch)."""

from __future__ import annotations

from pathlib import Path

from sharp.serving.backends import BACKENDS, Backend, BackendError


def check_model_path(path: str | Path, backend: str) -> Path:
    """`path` as a file `backend` could serve, judged by its name alone; raises BackendError saying what was found
    and what was expected (before any process or runtime starts)."""
    path = Path(path)
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if path.is_dir():
        raise BackendError(
            f"{path}: a directory; export a Hugging Face model directory with `sharp-export {path} -o model.onnx`"
            " and serve the file"
        )
    if not path.is_file():
        expected = {
            "onnxruntime": "an .onnx file",
            "torch": "a model.pt",
            "tensorrt": "an engine from sharp-build-engine",
        }
        raise BackendError(f"{path}: no such file (expected {expected[backend]})")
    if backend == "onnxruntime" and path.suffix == ".pt":
        raise BackendError(f"{path}: a checkpoint; export it with sharp-export, or serve it with --backend torch")
    if backend == "torch" and path.suffix == ".onnx":
        raise BackendError(f"{path}: an ONNX file; --backend torch serves a model.pt checkpoint, serve this file with"
                           " --backend onnxruntime")  # fmt: skip
    return path


def load_backend(path: str | Path, backend: str = "onnxruntime", device: str = "cpu", **kw) -> Backend:
    """The backend for `path`; raises BackendError with what was found and what was expected."""
    path = check_model_path(path, backend)
    if backend == "tensorrt":
        from sharp.serving.tensorrt_backend import TensorRTBackend

        return TensorRTBackend(path, device)
    if backend == "onnxruntime":
        from sharp.serving.onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend(path, device, **kw)
    from sharp.serving.torch_backend import TorchBackend

    return TorchBackend(path, device, **kw)
