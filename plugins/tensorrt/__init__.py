"""sharp::SharpAttention as a TensorRT plugin: the Triton kernels compiled ahead of time, registered through
TensorRT's Python plugin API (`tensorrt.plugin`, TensorRT ≥ 10.10). Importing this package never needs TensorRT;
`register(manifest_dir)` does (docs/tensorrt.md)."""

from sharp.plugins.tensorrt.plugin import (
    PLUGIN_NAME,
    KernelManifest,
    TensorRTUnavailable,
    import_tensorrt,
    register,
)

__all__ = ["PLUGIN_NAME", "KernelManifest", "TensorRTUnavailable", "import_tensorrt", "register"]
