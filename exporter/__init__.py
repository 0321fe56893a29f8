"""sharp.exporter — lowers a sharp or Hugging Face model to ONNX with sharp::SharpAttention nodes and their
standard-op fallback bodies (`sharp-export`): the op contract, the file's metadata, --genai packages, the TensorRT
form and its engines (`sharp-build-engine`)."""
