"""Model backends behind one interface: the engine batches, samples and streams; a backend runs one forward.

Both take the flat tensors of the exported generation graph (exporter/export.py, Optimum names): left-padded
`input_ids` (B, L), `attention_mask` (B, past + L), `position_ids` (B, L) and per-layer past keys/values
(B, kv_heads, past, head_dim); they return the last position's logits, the presents and the per-head
attention entropy (B, layers, heads, L) from the attention itself.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from sharp.exporter import metadata
from sharp.exporter.metadata import LayerAttention, ModelMetadata
from sharp.models.config import ModelShape
from sharp.models.tokenizer import Tokenizer
from sharp.plugins.onnxruntime import choose_library

log = logging.getLogger("sharp.serving")

BACKENDS = ("onnxruntime", "torch", "tensorrt")
# On CPU, from this many keys on the torch backend runs the streamed attention (O(n) memory) instead of the
# reference, whose (queries × keys) logits grow quadratically with the prompt.
STREAMED_FROM_KEYS = 1024


class BackendError(Exception):
    """The model file cannot be served (missing, wrong kind, unsupported architecture)."""


@dataclass(frozen=True)
class ModelSpec:
    """What the engine and GetModelInfo need to know about the served model, from its metadata."""

    name: str
    backend: str
    metadata: ModelMetadata
    config: ModelShape = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", self.metadata.shape)

    @property
    def norm(self) -> str:
        return self.metadata.norm

    @property
    def tokenizer(self) -> Tokenizer:
        return self.metadata.tokenizer

    @property
    def attention(self) -> list[LayerAttention]:
        return self.metadata.layers

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @property
    def layers(self) -> int:
        return self.config.layers

    @property
    def heads(self) -> int:
        return self.config.heads

    @property
    def kv_heads(self) -> int:
        return self.config.kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 4


@dataclass
class StepOutput:
    logits: Tensor  # (B, V) at each row's last position
    presents: list[Tensor]  # 2 × layers of (B, kv_heads, past + L, head_dim)
    entropy: Tensor | None  # (B, layers, heads, L) nats, when asked


class Backend(ABC):
    spec: ModelSpec
    device: torch.device

    @abstractmethod
    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, past: list[Tensor], entropy: bool
    ) -> StepOutput: ...

    def empty_past(self, batch: int) -> list[Tensor]:
        s = self.spec
        return [torch.zeros(batch, s.kv_heads, 0, s.head_dim, device=self.device) for _ in range(2 * s.layers)]


class OnnxRuntimeBackend(Backend):
    """A file written by `sharp-export` with a KV cache, run by onnxruntime (CPU; CUDA when available)."""

    def __init__(
        self, path: Path, device: str = "cpu", op_library: str | None = None, threads: int = 0, native: bool = True
    ):
        import onnx
        import onnxruntime as ort

        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # onnx raises DecodeError and friends for non-ONNX bytes
            raise BackendError(
                f"{path}: not an ONNX file ({type(e).__name__}); expected a file from sharp-export"
            ) from e
        try:
            meta = metadata.read(proto)
            metadata.check_graph(meta, proto)
        except metadata.MetadataError as e:
            raise BackendError(f"{path}: {e}") from None
        if not meta.export.get("kv_cache", False):
            raise BackendError(f"{path}: exported without a KV cache; re-export without --no-kv-cache to serve it")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        op_library, self.attention = choose_library(native, op_library)
        log.info("%s", self.attention)
        if op_library:  # a native sharp::SharpAttention kernel replaces the standard-op fallback bodies
            options.register_custom_ops_library(op_library)
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise BackendError("--device cuda needs onnxruntime-gpu (pip install 'sharp-attention[gpu]')")
            providers.insert(0, "CUDAExecutionProvider")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as e:  # e.g. a --fallback none file without a kernel: say which attention was chosen
            raise BackendError(f"{path}: onnxruntime cannot load it ({self.attention}): {e}") from None
        self.device = torch.device("cpu")  # inputs and outputs travel as host arrays
        self.spec = ModelSpec(Path(path).stem, "onnxruntime", meta)
        self.past_names = [i.name for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def forward(self, input_ids, attention_mask, position_ids, past, entropy):
        feed = {
            "input_ids": input_ids.numpy(),
            "attention_mask": attention_mask.numpy(),
            "position_ids": position_ids.numpy(),
            **{name: t.numpy() for name, t in zip(self.past_names, past, strict=True)},
        }
        names = self.output_names if entropy else self.output_names[:-1]
        logits, *rest = self.session.run(names, feed)
        presents = rest[:-1] if entropy else rest
        return StepOutput(
            torch.from_numpy(np.ascontiguousarray(logits[:, -1])),
            [torch.from_numpy(p) for p in presents],
            torch.from_numpy(rest[-1]) if entropy else None,
        )


class TorchBackend(Backend):
    """A sharp `model.pt` (SharpLM) in PyTorch; on CUDA the attention runs the Triton kernels, on CPU the reference
    or, for long contexts, the streamed attention."""

    def __init__(self, path: Path, device: str = "cpu"):
        from sharp.models import CheckpointError, SharpLM, load

        try:
            model = load(path)
        except CheckpointError as e:
            raise BackendError(str(e)) from e
        if not isinstance(model, SharpLM):
            raise BackendError(f"{path}: a {type(model).__name__} checkpoint; only SharpLM language models generate")
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendError("--device cuda: no CUDA device is visible to torch")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.impl = "triton" if self.device.type == "cuda" else "reference"
        self.spec = ModelSpec(Path(path).stem, "torch", metadata.ModelMetadata.from_model(model))

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask, position_ids, past, entropy):
        cache = [(past[2 * i], past[2 * i + 1]) for i in range(self.spec.layers)]
        impl = self.impl
        if impl == "reference" and attention_mask.shape[1] >= STREAMED_FROM_KEYS:
            impl = "streamed"
        out = self.model.step(
            input_ids.to(self.device),
            cache=cache,
            positions=position_ids.to(self.device),
            key_mask=attention_mask.to(self.device, torch.bool),
            return_entropy=entropy,
            impl=impl,
        )
        presents = [t for kv in out.cache for t in kv]
        ent = out.entropy.float().cpu() if entropy else None
        return StepOutput(out.logits[:, -1].float().cpu(), presents, ent)


class TensorRTBackend(Backend):
    """An engine built by sharp-build-engine, on CUDA: one execution context per optimization profile (prefill
    without a past, decode with one), the steps on a dedicated CUDA stream, I/O as torch CUDA tensors.

    Not verified: TensorRT could not be installed where this was written (docs/tensorrt.md)."""

    def __init__(self, path: Path, device: str = "cuda"):
        from sharp.plugins.tensorrt import TensorRTUnavailable, import_tensorrt
        from sharp.plugins.tensorrt.engine import PROFILES, read_metadata

        if device != "cuda":
            raise BackendError("--backend tensorrt runs on --device cuda")
        try:
            meta = read_metadata(path)
        except metadata.MetadataError as e:
            raise BackendError(f"{path}: {e}") from None
        try:
            trt, _ = import_tensorrt()
        except TensorRTUnavailable as e:
            raise BackendError(str(e)) from None
        if not torch.cuda.is_available():
            raise BackendError("--backend tensorrt: no CUDA device is visible to torch")
        self.device = torch.device("cuda")
        self.stream = torch.cuda.Stream()
        self.trt = trt
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise BackendError(f"{path}: TensorRT cannot deserialize it (built by another TensorRT version?)")
        self.contexts = []
        for index in range(len(PROFILES)):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.contexts.append(context)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.past_names = sorted((n for n in names if n.startswith("past_key_values.")), key=names.index)
        self.spec = ModelSpec(Path(path).stem, "tensorrt", meta)

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask, position_ids, past, entropy):
        from sharp.plugins.tensorrt.engine import profile_for

        context = self.contexts[profile_for(input_ids.shape[1], past[0].shape[2] if past else 0)]
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds.update(zip(self.past_names, past, strict=True))
        with torch.cuda.stream(self.stream):
            keep = {name: t.to(self.device).contiguous() for name, t in feeds.items()}
            for name, t in keep.items():
                context.set_input_shape(name, tuple(t.shape))
                context.set_tensor_address(name, t.data_ptr())
            results = {}
            for name in self.outputs:
                dtype = torch.float32 if self.engine.get_tensor_dtype(name) == self.trt.float32 else torch.float16
                results[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=dtype, device=self.device)
                context.set_tensor_address(name, results[name].data_ptr())
            if not context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT could not run the step")
        self.stream.synchronize()
        presents = [results[n].float() for n in self.outputs if n.startswith("present.")]
        ent = results["attention_entropy"].float().cpu() if entropy else None
        return StepOutput(results["logits"][:, -1].float().cpu(), presents, ent)


def load_backend(path: str | Path, backend: str = "onnxruntime", device: str = "cpu", **kw) -> Backend:
    """The backend for `path`; raises BackendError with what was found and what was expected."""
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
    if backend == "tensorrt":
        return TensorRTBackend(path, device)
    if backend == "onnxruntime":
        if path.suffix == ".pt":
            raise BackendError(f"{path}: a checkpoint; export it with sharp-export, or serve it with --backend torch")
        return OnnxRuntimeBackend(path, device, **kw)
    return TorchBackend(path, device)
