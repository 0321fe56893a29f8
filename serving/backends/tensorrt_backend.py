"""The TensorRT backend: an engine from sharp-build-engine run as the generation graph (serving/backends/interface.py:
GraphBackend). Not verified: TensorRT could not be installed where this was written (docs/tensorrt.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from sharp.exporter import metadata
from sharp.serving.backends.interface import BackendError, GraphBackend, StepOutput
from sharp.serving.spec import ModelSpec


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
        torch.set_num_threads(1)  # torch only moves a step's small tensors here; its spinning pool costs CPU
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
        self.spec = ModelSpec(meta.name or Path(path).stem, "tensorrt", meta)
        GraphBackend.__init__(self)

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask, position_ids, past, entropy, last=None, in_place=False, every=False):
        from sharp.exporter.build_engine import profile_for

        context = self.contexts[profile_for(input_ids.shape[1], past[0].shape[2] if past else 0)]
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds.update(zip(self.past_names, past, strict=True))
        with torch.cuda.stream(self.stream):
            keep = {name: torch.as_tensor(t, device=self.device).contiguous() for name, t in feeds.items()}
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
        ent = results["attention_entropy"].float().cpu().numpy() if entropy else None
        logits = results["logits"]
        rows = torch.arange(len(logits), device=logits.device)
        picked = logits[:, -1] if last is None else logits[rows, torch.as_tensor(last, device=logits.device)]
        full = logits.float().cpu().numpy() if every else None
        return StepOutput(picked.float().cpu().numpy(), presents, ent, full)
