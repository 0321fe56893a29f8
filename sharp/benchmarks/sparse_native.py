"""The native onnxruntime op's side of `sharp-bench sparse-decode --native`: the attention of a decode step of the
same models, on the same keys, through `sharp::SharpAttention`'s cache form run in place (as sharp-serve runs it),
with the key summary (entmax sparse), without it (entmax dense), and for the softmax model.

A decode step of each model is captured layer by layer where the torch backend's paged layer attends (its
post-RoPE query, the layer's keys and values, its normaliser's parameters); each layer becomes a one-node session
whose presents are bound to the pasts' own buffers, so a run writes one key and copies nothing. A step's time is
the sum over the layers' runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from sharp.exporter import cache_form
from sharp.exporter.op_schema import OP_INPUTS
from sharp.models import registry
from sharp.models.kvcache import PagedLayer
from sharp.plugins.onnxruntime import library_path

PAGE = cache_form.PAGE


@dataclass
class Captured:
    """One layer's attention in a decode step: q (1, Hq, 1, D), the layer's keys and values (1, Hkv, L, D) with
    the new token's last, and the normaliser's parameters as the paged layer received them."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    norm: dict


def capture(step_fn) -> list[Captured]:
    """Run `step_fn` (one decode step of a model on a paged cache) and record each layer's attention inputs."""
    seen: list[Captured] = []
    attend = PagedLayer.attend

    def recording(self, q, impl, entropy=True, **norm):
        k, v, _ = self.dense()
        seen.append(Captured(q.float().numpy().copy(), k.float().numpy().copy(), v.float().numpy().copy(), norm))
        return attend(self, q, impl, entropy, **norm)

    PagedLayer.attend = recording
    try:
        step_fn()
    finally:
        PagedLayer.attend = attend
    return seen


def _summary(keys: np.ndarray) -> np.ndarray:
    """The exact key summary of (1, Hkv, W, D) keys: (1, Hkv, ⌈W/16⌉, 2, D)."""
    b, h, w, d = keys.shape
    pages = -(-w // PAGE)
    padded = np.concatenate([keys, np.repeat(keys[:, :, -1:], pages * PAGE - w, 2)], 2).reshape(b, h, pages, PAGE, d)
    return np.stack([padded.min(3), padded.max(3)], 3).astype(np.float32)


class Layer:
    """One captured layer as an in-place cache-form session: `run()` times one decode step's attention."""

    def __init__(self, c: Captured, summary: bool, threads: int):
        name = str(c.norm.get("norm", "softmax"))
        entry = registry.get(name)
        hq, d, hkv = c.q.shape[1], c.q.shape[3], c.k.shape[1]
        scale = c.norm.get("scale") or d**-0.5
        used = {
            "Q",
            "K",
            "V",
            *entry.op_inputs(),
            *(("alibi_slopes",) if c.norm.get("alibi_slopes") is not None else ()),
        }
        names = [n if n in used else "" for n in OP_INPUTS] + list(cache_form.CACHE_INPUTS)
        outputs = ["O", "entropy", *cache_form.CACHE_OUTPUTS]
        if summary:
            names += list(cache_form.SUMMARY_INPUTS)
            outputs += list(cache_form.SUMMARY_OUTPUTS)
        node = helper.make_node("SharpAttention", names, outputs, domain="sharp", norm=name, causal=1,
                                scale=float(scale), q_heads=hq, kv_heads=hkv)  # fmt: skip
        node.overload = cache_form.overload(name, summary)
        ints = ("past_length", "summary_length")
        kind = {n: TensorProto.INT64 if n in ints else TensorProto.FLOAT for n in names}
        graph = helper.make_graph(
            [node],
            "layer",
            [helper.make_tensor_value_info(n, kind[n], None) for n in names if n],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("sharp", 1)],
                                  ir_version=10)  # fmt: skip
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.register_custom_ops_library(library_path())
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        w = c.k.shape[2] - 1
        feed = {"Q": c.q, "K": np.ascontiguousarray(c.k[:, :, w:]), "V": np.ascontiguousarray(c.v[:, :, w:]),
                "past_length": np.array([w], np.int64)}  # fmt: skip
        for slot in ("alpha", "query_scale", "alibi_slopes", *(p.name for p in entry.params)):
            if slot in used and slot not in feed and c.norm.get(slot) is not None:
                value = torch.as_tensor(c.norm[slot], dtype=torch.float32)
                feed[slot] = value.expand(hq).numpy().copy() if value.dim() == 0 else value.numpy().copy()
        pasts = {"past_key": c.k.copy(), "past_value": c.v.copy()}  # room for the step's key, written in place
        if summary:
            pasts["past_key_summary"] = _summary(pasts["past_key"])
            feed["summary_length"] = np.array([w], np.int64)
        self.arrays = pasts  # kept alive: the session writes into them
        self.binding = self.session.io_binding()
        for n, value in feed.items():
            self.binding.bind_cpu_input(n, value)
        self.binding.bind_output("O")
        self.binding.bind_output("entropy")
        for past, present in zip(("past_key", "past_value", *(("past_key_summary",) if summary else ())),
                                 (*cache_form.CACHE_OUTPUTS, *(cache_form.SUMMARY_OUTPUTS if summary else ())),
                                 strict=True):  # fmt: skip
            shared = ort.OrtValue.ortvalue_from_numpy(pasts[past])
            self.binding.bind_ortvalue_input(past, shared)
            self.binding.bind_ortvalue_output(present, shared)

    def run(self) -> tuple[float, np.ndarray]:
        began = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        took = time.perf_counter() - began
        return took, self.binding.get_outputs()[0].numpy()


def step_time(layers: list[Layer]) -> float:
    """One decode step's attention: the sum of its layers' runs (s)."""
    return sum(layer.run()[0] for layer in layers)
