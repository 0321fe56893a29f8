"""The backends: the one interface, onnxruntime, TensorRT and torch, the sampler each provides, and the loader that
picks one."""
