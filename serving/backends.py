"""Model backends behind one interface: the engine batches, samples and streams; a backend runs the model over the
sequences it is given and owns their KV cache.

The engine speaks in sequences: `reserve` room for one (or hear that it does not fit now), `prefill` a chunk of its
prompt, `join` it to the decode batch, `decode` one token for every running sequence, `release` it. How keys and
values are kept is the backend's business:
- `GraphBackend` (onnxruntime, TensorRT) runs the exported generation graph, whose flat tensors are left-padded
  `input_ids` (B, L), `attention_mask` (B, past + L), `position_ids` (B, L) and per-layer past keys/values
  (B, kv_heads, past, head_dim) (exporter/export.py, Optimum names): the running batch shares one left-padded
  cache (serving/cache.py), so its memory follows the longest sequence;
- `TorchBackend` runs a SharpLM on a paged KV cache (models/kvcache.py): each sequence holds only its own pages, a
  sequence joins and leaves without moving data, and on CUDA the attention reads the pages with the Triton kernels.
A row the model fails on in a batched decode ends alone: the rows are run one by one and only failing ones end.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from sharp.exporter import metadata
from sharp.models.kvcache import OutOfPages, PagedKVCache
from sharp.plugins.onnxruntime import NativeOpUnavailable, choose_library
from sharp.serving.cache import BatchCache
from sharp.serving.spec import ModelSpec

log = logging.getLogger("sharp.serving")

BACKENDS = ("onnxruntime", "torch", "tensorrt")
# On CPU, from this many keys on the torch backend runs the streamed attention (O(n) memory) instead of the
# reference, whose (queries × keys) logits grow quadratically with the prompt.
STREAMED_FROM_KEYS = 1024
PAGE_SIZE = 16  # tokens per KV page of the torch backend (a kernel tile: decode reads whole pages)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class BackendError(Exception):
    """The model file cannot be served (missing, wrong kind, unsupported architecture)."""


@dataclass
class StepOutput:
    """What a forward of the generation graph returns."""

    logits: Tensor  # (B, V) at each row's last position
    presents: list[Tensor]  # 2 × layers of (B, kv_heads, past + L, head_dim)
    entropy: Tensor | None  # (B, layers, heads, L) nats, when asked


@dataclass
class StepResult:
    """What the engine receives from a prefill chunk or a decode step: the last position's logits (B, V) and the
    per-head entropy (B, layers, heads, L) of the rows that ran, in order, and the sequences the model failed on
    (left out of both)."""

    logits: Tensor
    entropy: Tensor | None
    failed: list[Hashable] = field(default_factory=list)


class Backend(ABC):
    spec: ModelSpec
    device: torch.device
    kv_bytes_per_token: int  # what one token of one sequence costs in the KV cache

    @abstractmethod
    def allocate(self, budget_bytes: int) -> int:
        """Set up the KV cache within `budget_bytes`; returns the bytes it can hold (what requests are checked
        against). Raises BackendError if not even one token fits."""

    @abstractmethod
    def reserve(self, seq: Hashable, tokens: int) -> bool:
        """Room for `seq` to hold `tokens` tokens, or False (nothing reserved) when that does not fit now."""

    @abstractmethod
    def prefill(self, seq: Hashable, ids: Tensor, start: int, entropy: bool) -> StepResult:
        """ids (1, n): the reserved sequence's prompt tokens start..start+n−1, after its first `start`."""

    def join(self, seq: Hashable) -> None:  # noqa: B027  (a no-op unless the running batch has its own cache)
        """The sequence's prompt is in: it decodes with the others from now on."""

    @abstractmethod
    def release(self, seq: Hashable) -> None:
        """The sequence left (finished, cancelled, failed); unknown sequences are ignored."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every sequence (after a failure the engine could not attribute)."""

    @abstractmethod
    def kv_usage(self) -> float:
        """The fraction of the KV cache in use (the metrics' gauge)."""

    @abstractmethod
    def _decode_step(self, seqs: list[Hashable], tokens: Tensor, entropy: bool) -> StepResult:
        """One batched decode step: tokens (B, 1) the sequences' last sampled tokens."""

    def _unbatch(self, seqs: list[Hashable]) -> None:  # noqa: B027
        """Before running the rows alone: give each row what `_decode_step([seq])` needs."""

    def _rebatch(self, seqs: list[Hashable]) -> None:  # noqa: B027
        """After running the rows alone: the survivors form the batch again, in order."""

    def decode(self, seqs: list[Hashable], tokens: Tensor, entropy: bool) -> StepResult:
        """One token for each of `seqs` (the running batch, in order). If the batched step raises, each row runs
        alone and only the rows that raise again are reported failed."""
        try:
            return self._decode_step(seqs, tokens, entropy)
        except Exception:
            log.warning("a batched decode step of %d rows failed; running them one by one", len(seqs))
        self._unbatch(seqs)
        kept, results, failed = [], [], []
        for i, seq in enumerate(seqs):
            try:
                results.append(self._decode_step([seq], tokens[i : i + 1], entropy))
                kept.append(seq)
            except Exception:
                log.exception("decode failed for one row")
                failed.append(seq)
        self._rebatch(kept)
        if not kept:
            return StepResult(torch.empty(0, self.spec.vocab_size), None, failed)
        ent = None if results[0].entropy is None else torch.cat([r.entropy for r in results])
        return StepResult(torch.cat([r.logits for r in results]), ent, failed)


class GraphBackend(Backend):
    """A backend that runs the exported generation graph (flat tensors in, presents out): prefilling sequences
    keep their own cache, running ones share one left-padded `BatchCache` whose memory is rows × the longest."""

    def __init__(self) -> None:
        self.kv_bytes_per_token = self.spec.kv_bytes_per_token()
        self.budget_bytes = 0
        self._batch = BatchCache()
        self._rows: list[Hashable] = []  # the batch cache's rows, in order
        self._own: dict[Hashable, list[Tensor]] = {}  # caches of sequences prefilling (or run alone)
        self._reserved: dict[Hashable, int] = {}

    @abstractmethod
    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, past: list[Tensor], entropy: bool
    ) -> StepOutput: ...

    def empty_past(self, batch: int) -> list[Tensor]:
        s = self.spec
        return [torch.zeros(batch, s.kv_heads, 0, s.head_dim, device=self.device) for _ in range(2 * s.layers)]

    def allocate(self, budget_bytes: int) -> int:
        if budget_bytes < self.kv_bytes_per_token:
            raise BackendError(f"a KV budget of {budget_bytes} bytes holds no token ({self.kv_bytes_per_token} each)")
        self.budget_bytes = budget_bytes
        return budget_bytes

    def reserve(self, seq, tokens):
        wanted = {**self._reserved, seq: tokens}
        if len(wanted) * max(wanted.values()) * self.kv_bytes_per_token > self.budget_bytes:
            return False  # the batch cache pads every row to the longest one
        self._reserved = wanted
        return True

    def prefill(self, seq, ids, start, entropy):
        n = ids.shape[1]
        past = self._own.get(seq) or self.empty_past(1)
        out = self.forward(
            ids, torch.ones(1, start + n, dtype=torch.int64), torch.arange(start, start + n)[None], past, entropy
        )
        self._own[seq] = out.presents
        return StepResult(out.logits, out.entropy)

    def join(self, seq):
        cache = self._own.pop(seq)
        self._batch.join(cache, cache[0].shape[2])
        self._rows.append(seq)

    def release(self, seq):
        self._own.pop(seq, None)
        self._reserved.pop(seq, None)
        if seq in self._rows:
            row = self._rows.index(seq)
            self._rows.pop(row)
            self._batch.leave([row])

    def clear(self):
        self._batch, self._rows, self._own, self._reserved = BatchCache(), [], {}, {}

    def kv_usage(self):
        used = self._batch.slots() + sum(c[0].shape[2] for c in self._own.values())
        return used * self.kv_bytes_per_token / self.budget_bytes

    def _decode_step(self, seqs, tokens, entropy):
        if seqs == self._rows:
            cache = self._batch
            out = self.forward(
                tokens, cache.attention_mask(), torch.tensor(cache.lengths)[:, None], cache.tensors, entropy
            )
            cache.advance(out.presents)
        else:  # a row run alone (after _unbatch)
            (seq,) = seqs
            past = self._own[seq]
            n = past[0].shape[2]
            out = self.forward(tokens, torch.ones(1, n + 1, dtype=torch.int64), torch.tensor([[n]]), past, entropy)
            self._own[seq] = out.presents
        return StepResult(out.logits, out.entropy)

    def _unbatch(self, seqs):
        for i, seq in enumerate(self._rows):
            self._own[seq] = self._batch.row(i)
        self._batch, self._rows = BatchCache(), []

    def _rebatch(self, seqs):
        for seq in seqs:  # rows that failed keep their own cache until the engine releases them
            self.join(seq)


class OnnxRuntimeBackend(GraphBackend):
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
        try:
            op_library, self.attention = choose_library(
                native, op_library, tensorrt_form=meta.export.get("tensorrt", False)
            )
        except NativeOpUnavailable as e:
            raise BackendError(str(e)) from None
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
        GraphBackend.__init__(self)
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
    """A sharp `model.pt` (SharpLM) in PyTorch on a paged KV cache. On CUDA the attention runs the Triton kernels
    (decode steps and short chunks read the pages directly; long prefill chunks run the prefill kernels over the
    sequence's keys, a view of the pool when its pages are consecutive); on CPU the reference or, from
    STREAMED_FROM_KEYS keys, the streamed attention over the same keys.
    `impl` overrides that choice (e.g. "triton" in the CPU interpreter); `dtype` is the weights' and the cache's
    (default fp32 on CPU, bf16 on CUDA)."""

    def __init__(self, path: Path, device: str = "cpu", impl: str | None = None, dtype: str | None = None):
        from sharp.models import CheckpointError, SharpLM, load

        try:
            model = load(path)
        except CheckpointError as e:
            raise BackendError(str(e)) from e
        if not isinstance(model, SharpLM):
            raise BackendError(f"{path}: a {type(model).__name__} checkpoint; only SharpLM language models generate")
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendError("--device cuda: no CUDA device is visible to torch")
        dtype = dtype or ("bf16" if device == "cuda" else "fp32")
        if dtype not in DTYPES:
            raise BackendError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
        self.device, self.dtype = torch.device(device), DTYPES[dtype]
        self.model = model.to(self.device, self.dtype).eval()
        self.impl = impl
        if impl is not None:
            self.attention = f"attention: impl={impl!r} (torch, {device})"
        elif device == "cuda":
            self.attention = "attention: sharp's Triton kernels (paged decode, fused prefill)"
        else:
            self.attention = f"attention: torch reference, streamed from {STREAMED_FROM_KEYS} keys"
        self.spec = ModelSpec(Path(path).stem, "torch", metadata.ModelMetadata.from_model(model))
        self.kv_bytes_per_token = self.spec.kv_bytes_per_token(self.dtype.itemsize)
        self.cache: PagedKVCache | None = None

    def allocate(self, budget_bytes):
        pages = budget_bytes // (PAGE_SIZE * self.kv_bytes_per_token)
        if pages < 1:
            raise BackendError(
                f"a KV budget of {budget_bytes} bytes holds no page of {PAGE_SIZE} tokens"
                f" ({PAGE_SIZE * self.kv_bytes_per_token} bytes)"
            )
        s = self.spec
        self.cache = PagedKVCache(s.layers, s.kv_heads, s.head_dim, pages, PAGE_SIZE, self.device, self.dtype)
        return pages * PAGE_SIZE * self.kv_bytes_per_token

    def reserve(self, seq, tokens):
        try:
            self.cache.reserve(seq, tokens)
        except OutOfPages:
            return False
        return True

    def release(self, seq):
        self.cache.free(seq)

    def clear(self):
        self.cache.clear()

    def kv_usage(self):
        return self.cache.allocator.usage()

    def _attention(self, keys: int) -> str:
        if self.impl is not None:
            return self.impl
        if self.device.type == "cuda":
            return "triton"
        return "streamed" if keys >= STREAMED_FROM_KEYS else "reference"

    @torch.inference_mode()
    def _run(self, seqs: list[Hashable], ids: Tensor, positions: Tensor, entropy: bool) -> StepResult:
        step = self.cache.step(seqs, ids.shape[1])
        out = self.model.step(
            ids.to(self.device),
            cache=step,
            positions=positions.to(self.device),
            return_entropy=entropy,
            impl=self._attention(step.longest),
        )
        step.commit()  # only a step that ran through every layer counts; a failed one can run again
        ent = out.entropy.float().cpu() if entropy else None
        return StepResult(out.logits[:, -1].float().cpu(), ent)

    def prefill(self, seq, ids, start, entropy):
        return self._run([seq], ids, torch.arange(start, start + ids.shape[1])[None], entropy)

    def _decode_step(self, seqs, tokens, entropy):
        positions = torch.tensor([[self.cache.lengths[s]] for s in seqs])
        return self._run(seqs, tokens, positions, entropy)


class TensorRTBackend(GraphBackend):
    """An engine built by sharp-build-engine, on CUDA: one execution context per optimization profile (prefill
    without a past, decode with one), the steps on a dedicated CUDA stream, I/O as torch CUDA tensors.

    Not verified: TensorRT could not be installed where this was written (docs/tensorrt.md)."""

    def __init__(self, path: Path, device: str = "cuda"):
        from sharp.exporter.build_engine import PROFILES
        from sharp.plugins.tensorrt import TensorRTUnavailable, import_tensorrt

        if device != "cuda":
            raise BackendError("--backend tensorrt runs on --device cuda")
        try:
            meta = metadata.read_plan(path)
        except metadata.MetadataError as e:
            raise BackendError(f"{path}: {e}") from None
        try:
            trt, _ = import_tensorrt()
        except TensorRTUnavailable as e:
            raise BackendError(str(e)) from None
        if not torch.cuda.is_available():
            raise BackendError("--backend tensorrt: no CUDA device is visible to torch")
        self.device = torch.device("cuda")
        self.attention = "attention: the TensorRT plugin (sharp's ahead-of-time Triton kernels)"
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
        GraphBackend.__init__(self)

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask, position_ids, past, entropy):
        from sharp.exporter.build_engine import profile_for

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
    if path.suffix == ".onnx":
        raise BackendError(f"{path}: an ONNX file; --backend torch serves a model.pt checkpoint, serve this file with"
                           " --backend onnxruntime")  # fmt: skip
    return TorchBackend(path, device, **kw)
