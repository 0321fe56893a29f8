"""sharp.plugins — the kernels behind sharp::SharpAttention: ONNX Runtime's native CPU library (onnxruntime/),
the Triton GPU kernels (triton/) and the TensorRT plugin built from them (tensorrt/)."""
