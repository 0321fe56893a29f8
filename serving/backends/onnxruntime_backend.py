"""The onnxruntime backend: a file written by sharp-export with a KV cache, run as the generation graph
(serving/backends/interface.py: GraphBackend)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from sharp.exporter import kept_logits, metadata
from sharp.plugins.onnxruntime import NativeOpUnavailable, choose_library
from sharp.serving.backends.interface import BackendError, GraphBackend, StepOutput
from sharp.serving.spec import ModelSpec


class OnnxRuntimeBackend(GraphBackend):
    """A file written by `sharp-export` with a KV cache, run by onnxruntime (CPU; CUDA when available)."""

    def __init__(
        self, path: Path, device: str = "cpu", op_library: str | None = None, threads: int = 0, native: bool = True
    ):
        try:  # the metadata alone: the graph and its weights are onnxruntime's to load (one copy in memory)
            meta = metadata.read(path)
        except metadata.MetadataError as e:
            raise BackendError(f"{path}: {e}; expected a file from sharp-export") from None
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
        try:
            metadata.check_graph(meta, _dims(self.session.get_inputs()), _dims(self.session.get_outputs()))
        except metadata.MetadataError as e:
            raise BackendError(f"{path}: {e}") from None
        self.spec = ModelSpec(meta.name or Path(path).stem, "onnxruntime", meta)
        self.in_place = bool(meta.export.get("kv_in_place", False))  # the op's cache form (exporter/cache_form.py)
        GraphBackend.__init__(self)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.past_names = [n for n in self.input_names if n.startswith("past_key_values.")]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.present_names = [n for n in self.output_names if n.startswith("present.")]
        self._binding: _Binding | None = None  # the running batch's buffers, bound

    def release(self, seq, keep=None):
        super().release(seq, keep)
        if self._batch.tensors is None:  # the batch is gone: so is its buffers' binding (it keeps them alive)
            self._binding = None

    def clear(self):
        super().clear()
        self._binding = None

    def forward(self, input_ids, attention_mask, position_ids, past, entropy, last=None, in_place=False, every=False):
        if in_place and input_ids.shape[1] == 1 and last is None and not every:
            return self._forward_in_place(input_ids, attention_mask, position_ids, past, entropy)
        if in_place:
            return self._forward_into(input_ids, attention_mask, position_ids, past, entropy, last, every)
        feed = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            **dict(zip(self.past_names, past, strict=True)),
            **kept_logits.feed(self.input_names, _keep(last, every)),
        }
        names = self.output_names if entropy else self.output_names[:-1]
        logits, *rest = self.session.run(names, feed)
        presents = rest[:-1] if entropy else rest
        picked = logits[:, -1] if last is None else logits[np.arange(len(logits)), last]
        ent = rest[-1] if entropy else None
        return StepOutput(np.ascontiguousarray(picked), presents, ent, logits if every else None)

    def _forward_into(self, input_ids, attention_mask, position_ids, past, entropy, last, every):
        """A step of several tokens (a prefill chunk) whose attention writes its keys into `past` itself, each present
        bound to its past's memory; the logits and entropies are left to onnxruntime (their shapes vary by chunk)."""
        binding = self.session.io_binding()
        names = ["logits", *(["attention_entropy"] if entropy else [])]
        for name in names:  # bound first: get_outputs() keeps this order
            binding.bind_output(name)
        _bind_cache(self, binding, past)
        small = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        small.update(kept_logits.feed(self.input_names, _keep(last, every)))
        for name, array in small.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        logits = outputs[0].numpy()
        picked = logits[:, -1] if last is None else logits[np.arange(len(logits)), last]
        ent = outputs[1].numpy() if entropy else None
        return StepOutput(np.ascontiguousarray(picked), past, ent, logits if every else None)

    def _forward_in_place(self, input_ids, attention_mask, position_ids, past, entropy):
        """A decode step whose attention writes its keys into `past` itself: each present is bound to its past's
        memory (onnxruntime's I/O binding), so the kernel writes only the new column and nothing is copied. The
        binding is kept while the buffers stay the same — a step rebinds only its three small inputs, and the
        logits and entropies land in arrays of the binding's own."""
        bound = self._binding
        if bound is None or bound.entropy != entropy or not bound.holds(past):
            bound = self._binding = _Binding(self, past, entropy)
        binding = bound.binding
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask))
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids))
        self.session.run_with_iobinding(binding)
        # copies: the next step writes the binding's arrays again
        ent = bound.entropy_out.copy() if entropy else None
        return StepOutput(bound.logits[:, -1].copy(), past, ent)


def _keep(last, every: bool) -> int:
    """`logits_to_keep` for a run: the last position's row alone, unless every position's logits are read (prompt
    log-probabilities) or rows end at different columns (`last`: a batched prefill); 0 keeps every position."""
    return 0 if every or last is not None else 1


def _bind_cache(backend: OnnxRuntimeBackend, binding: ort.IOBinding, past: list[np.ndarray]) -> None:
    """Each past buffer bound as its layer's input and as its present: the kernel writes into the same memory."""
    for name, present, buffer in zip(backend.past_names, backend.present_names, past, strict=True):
        shared = ort.OrtValue.ortvalue_from_numpy(buffer)  # the array's own memory, in and out
        binding.bind_ortvalue_input(name, shared)
        binding.bind_ortvalue_output(present, shared)


class _Binding:
    """The I/O binding of one set of decode buffers: each present bound to its past's memory, the logits (and
    entropies) to arrays of the binding's own. It keeps the buffers alive while onnxruntime points into them."""

    def __init__(self, backend: OnnxRuntimeBackend, past: list[np.ndarray], entropy: bool):
        s, rows = backend.spec, past[0].shape[0]
        self.past, self.entropy = list(past), entropy
        self.binding = backend.session.io_binding()
        self.logits = np.empty((rows, 1, s.vocab_size), np.float32)
        self.entropy_out: np.ndarray | None = None
        outputs = {"logits": self.logits}
        if entropy:
            self.entropy_out = outputs["attention_entropy"] = np.empty((rows, s.layers, s.heads, 1), np.float32)
        for name, array in outputs.items():
            self.binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
        _bind_cache(backend, self.binding, past)
        self.keep = kept_logits.feed(backend.input_names, 1)  # a step's one position (kept alive: it is bound)
        for name, array in self.keep.items():
            self.binding.bind_cpu_input(name, array)

    def holds(self, past: list[np.ndarray]) -> bool:
        return len(past) == len(self.past) and all(a is b for a, b in zip(past, self.past, strict=True))


def _dims(args) -> dict[str, metadata.Dims]:
    """onnxruntime's NodeArgs as name → dimensions (None where dynamic: onnxruntime names those or leaves None)."""
    return {a.name: [d if isinstance(d, int) else None for d in a.shape] for a in args}
