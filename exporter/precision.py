"""The weight precision of an exported file (`sharp-export --weights`), and how close it must stay to fp32.

fp32 is the graph as traced. fp16 and bf16 compute in half precision (`to_half`). int8 and int4 are
weight-only and blockwise: onnxruntime's own quantizer (`MatMulNBitsQuantizer`) turns every MatMul with a constant
2-D weight — the projections and an untied LM head — into `com.microsoft::MatMulNBits` (asymmetric, `block`
weights per scale, accuracy level 4: the kernel quantizes each activation block to int8 for its dot products, as
onnxruntime-genai's builder does for CPU — at level 0 the 8-bit kernel runs at a sixth of the speed). Under int4
the value and MLP down projections stay at 8 bits (the choice of llama.cpp's Q4_K_M: their error reaches the
residual stream unattenuated; on the trained zoo model it lifts top-1 agreement from 94.5% to 96.3%). The
embedding stays fp32: the quantizer's Gather form needs opset 21 and the file's fallback bodies are opset 18 — and a
tied LM head, a Transpose of it, stays fp32 with it. Norms and the attention op are untouched; activations stay
fp32.

Weights that already sit on a 4- or 8-bit blockwise grid — a quantized GGUF's, dequantized by the loader — are not
quantized again: exporter/grid.py writes them exactly, at their own bits (a tied LM head too, in a MatMulNBits of
its own beside the fp32 embedding), so a Q4_1 file is served with llama.cpp's weights (and, at accuracy level 4,
int8 activations in the dot products, as llama.cpp's Q4_1 × Q8_1 kernels have them).

A precision file is judged against the fp32 PyTorch model on text by `Agreement` and `BOUNDS` (docs/op.md).
"""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

QUANTIZED = {"int8": 8, "int4": 4}  # precision → bits of the projections
HALF = ("fp16", "bf16")
EXPORTABLE = ("fp32", *HALF, *QUANTIZED)
QUANT_BLOCK = 32
KEEP_8BIT = ("v_proj", "down_proj", "down")  # module names (transformers, SharpLM) int4 keeps at 8 bits
ACCURACY_LEVEL = 4
_SCOPES = "pkg.torch.onnx.name_scopes"  # the exporter's record of the module a node came from


class PrecisionError(ValueError):
    """The graph cannot take the precision asked for; the message says why and what can."""


def _module(node: onnx.NodeProto) -> str:
    """The last name of the module `node` was traced from ('' if the exporter did not record it)."""
    for prop in node.metadata_props:
        if prop.key == _SCOPES:
            scopes = ast.literal_eval(prop.value)  # a Python list literal, e.g. ['', 'model', …, 'v_proj', 'linear']
            return scopes[-2].rsplit(".", 1)[-1] if len(scopes) >= 2 else ""
    return ""


def weight_matmuls(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The main graph's MatMuls whose B is a constant 2-D initializer: what quantization can change."""
    shapes = {i.name: len(i.dims) for i in proto.graph.initializer}
    return [n for n in proto.graph.node if n.op_type == "MatMul" and shapes.get(n.input[1]) == 2]


def weight_bits(node: onnx.NodeProto, precision: str) -> int | None:
    """The bits `quantize` gives a weight MatMul's weight at `precision` (None: not quantized)."""
    bits = QUANTIZED.get(precision)
    return 8 if bits is not None and bits < 8 and _module(node) in KEEP_8BIT else bits


def fusion_key(proto: onnx.ModelProto, precision: str, block: int = QUANT_BLOCK) -> Callable[[onnx.NodeProto], object]:
    """What keeps sibling MatMuls apart (exporter/siblings.py): the bits `quantize` gives their weights — except that
    a weight int4 would keep at 8 bits but which already sits on a 4-bit grid (a Q4_x GGUF's value projection) is
    written at 4 bits there, so it fuses with its 4-bit siblings (a few columns decide; `quantize` checks them all)."""
    from sharp.exporter import grid

    weights = {i.name: i for i in proto.graph.initializer}

    def key(node: onnx.NodeProto) -> int | None:
        bits = weight_bits(node, precision)
        if bits != QUANTIZED.get(precision) and node.input[1] in weights:
            few = numpy_helper.to_array(weights[node.input[1]])[:, :64]
            return QUANTIZED[precision] if grid.find(few, QUANTIZED[precision], block) is not None else bits
        return bits

    return key


def check_block(block: int) -> None:
    if block < 16 or block & (block - 1):
        raise PrecisionError(f"`quant_block` must be a power of two >= 16 (MatMulNBits' blocks), got {block}")


def quantize(
    proto: onnx.ModelProto, precision: str, block: int = QUANT_BLOCK, accuracy_level: int = ACCURACY_LEVEL
) -> onnx.ModelProto:
    """`proto` with its weight MatMuls as MatMulNBits at `precision` (int8 or int4). `accuracy_level` 0 computes in
    fp32 (the tests' check that weights on a grid are written exactly; the 8-bit kernel is then ~8× slower)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    check_block(block)
    targets = weight_matmuls(proto)
    if not targets:
        raise PrecisionError(f"--weights {precision}: the graph has no MatMul with a constant weight to quantize")
    bits = QUANTIZED[precision]
    targets = _on_grids(proto, targets, block, accuracy_level)
    eight = {n.name for n in targets if weight_bits(n, precision) != bits}
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # it logs every node at INFO
    for width, names in ((8, eight), (bits, {n.name for n in targets} - eight)):
        if not names:
            continue
        config = DefaultWeightOnlyQuantConfig(
            block_size=block, is_symmetric=False, bits=width, accuracy_level=accuracy_level
        )
        others = [n.name for n in proto.graph.node if n.name not in names]
        quantizer = MatMulNBitsQuantizer(proto, algo_config=config, nodes_to_exclude=others)
        quantizer.process()
        proto = quantizer.model.model
    left = [n.name for n in weight_matmuls(proto) if n.name in {t.name for t in targets}]
    if left:  # the quantizer skips what it cannot take; a file labelled int4 must not hide fp32 projections
        raise PrecisionError(f"--weights {precision}: onnxruntime's quantizer left {len(left)} MatMuls in fp32")
    return proto


def _on_grids(
    proto: onnx.ModelProto, targets: list[onnx.NodeProto], block: int, accuracy_level: int
) -> list[onnx.NodeProto]:
    """Write the weights already on a 4- or 8-bit grid (a quantized GGUF's, exporter/grid.py) exactly, at the fewest
    bits that hold them (a Q8_0 tensor of a Q4_1 file keeps its 8 bits under int4, as llama.cpp keeps it). A tied LM
    head too: a MatMul on the Transpose of the embedding, whose fp32 table stays for the Gather — the head is most of
    what a small model's decode step reads. Returns the MatMuls left for onnxruntime's quantizer."""
    from sharp.exporter import grid

    graph = proto.graph
    weights = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    tied = [
        (n, producers[n.input[1]])
        for n in graph.node
        if n.op_type == "MatMul" and n.input[1] in producers and producers[n.input[1]].op_type == "Transpose"
        and producers[n.input[1]].input[0] in weights and len(weights[producers[n.input[1]].input[0]].dims) == 2
    ]  # fmt: skip

    def search(candidate: tuple[onnx.NodeProto, onnx.NodeProto | None]) -> grid.Grid | None:
        node, transpose = candidate
        w = numpy_helper.to_array(weights[transpose.input[0] if transpose else node.input[1]])
        w = w.T if transpose else w
        return next((g for b in (4, 8) if (g := grid.find(w, b, block)) is not None), None)

    candidates = [(n, None) for n in targets] + tied
    # numpy lets go of the GIL in the search's array passes: threads split it over the cores (SmolLM2: 9.7 → ~5 s)
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        grids = list(pool.map(search, candidates))
    left = []
    for (node, transpose), found in zip(candidates, grids, strict=True):
        if found is None:
            if transpose is None:
                left.append(node)
            continue
        grid.rewrite(proto, node, found, accuracy_level)
        if transpose is not None and not any(transpose.output[0] in n.input for n in graph.node):
            graph.node.remove(transpose)
    used = {i for n in graph.node for i in n.input}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return left


def _rotary_nodes(graph: onnx.GraphProto) -> list[str]:
    """Names of the nodes between `position_ids` and a Cos/Sin: the rotary angles. In fp16 an angle of 4,000 rad
    is rounded to 2 rad, so these stay fp32 and only the cos/sin values (in [-1, 1]) enter the half graph."""
    producers = {out: n for n in graph.node for out in n.output}
    after, frontier = set(), {"position_ids"}
    while frontier:
        nxt = {o for n in graph.node if set(n.input) & frontier for o in n.output} - after
        after |= nxt
        frontier = nxt
    keep, stack = set(), [n for n in graph.node if n.op_type in ("Cos", "Sin")]
    while stack:
        node = stack.pop()
        if node.name in keep or not (set(node.output) & after):
            continue
        keep.add(node.name)
        stack += [producers[i] for i in node.input if i in producers]
    return sorted(keep)


def to_half(proto: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """`proto` computing in fp16 or bf16 through onnxruntime's float16 converter: weights and activations in half
    precision; graph inputs and outputs (logits, entropy, the KV cache) stay fp32, and so do the attention op (its
    contract is fp32; Casts around it — its kernels and fallback bodies accumulate in fp32 anyway) and the rotary
    angles. bf16 is the converter's fp16 graph retyped, with the weights rounded from fp32 (not from fp16)."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    fp32 = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer} if precision == "bf16" else {}
    blocked = [*DEFAULT_OP_BLOCK_LIST, "SharpAttention"]
    proto = convert_float_to_float16(
        proto,
        keep_io_types=True,
        disable_shape_infer=True,
        op_block_list=blocked,
        node_block_list=_rotary_nodes(proto.graph),
    )
    if precision == "bf16":
        _retype_bf16(proto, fp32)
    OnnxModel(proto).topological_sort()  # the converter appends its Casts at the end
    del proto.graph.value_info[:]  # some carry the converter's guesses; onnxruntime infers them again
    return proto


def _bf16(values: np.ndarray, name: str) -> onnx.TensorProto:
    """`values` rounded to bfloat16 (round to nearest even on the upper 16 bits of the fp32 pattern)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    t = onnx.TensorProto(name=name, data_type=onnx.TensorProto.BFLOAT16, dims=values.shape)
    t.raw_data = rounded.tobytes()
    return t


def _retype_bf16(proto: onnx.ModelProto, fp32: dict[str, np.ndarray]) -> None:
    half, bf16 = onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16

    def tensor(t: onnx.TensorProto) -> onnx.TensorProto:
        if t.data_type != half:
            return t
        return _bf16(fp32[t.name] if t.name in fp32 else numpy_helper.to_array(t).astype(np.float32), t.name)

    inits = [tensor(t) for t in proto.graph.initializer]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(inits)
    for node in proto.graph.node:
        for a in node.attribute:
            if a.name == "to" and a.i == half:
                a.i = bf16
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == half:
                a.t.CopyFrom(tensor(a.t))
    for vi in (*proto.graph.input, *proto.graph.output):
        if vi.type.tensor_type.elem_type == half:
            vi.type.tensor_type.elem_type = bf16


@dataclass(frozen=True)
class Bound:
    """How far a file at a precision may drift from the fp32 model on the check's text (docs/op.md)."""

    kl: float  # mean KL(fp32 ‖ file) of the next-token distributions, nats
    top1: float  # top-1 agreement at the positions where fp32 is confident (top-1 probability ≥ 0.5)
    entropy: float  # mean |Δ attention entropy|, nats


BOUNDS = {
    "fp16": Bound(kl=1e-3, top1=0.99, entropy=0.01),
    "bf16": Bound(kl=1e-2, top1=0.98, entropy=0.05),  # estimated from fp16's (8× coarser); not run on a CPU
    "int8": Bound(kl=5e-3, top1=0.99, entropy=0.02),
    "int4": Bound(kl=5e-2, top1=0.95, entropy=0.2),
}
CPU_RUNS = ("fp32", "fp16", "int8", "int4")  # onnxruntime's CPU provider has no bfloat16 Pow, ReduceMean, …
CONFIDENT = 0.5


@dataclass(frozen=True)
class Agreement:
    """A precision file against fp32 over the check's positions."""

    positions: int
    max_logit_error: float
    top1: float  # at every position
    confident: int  # positions where fp32's top-1 probability is ≥ CONFIDENT
    confident_top1: float  # agreement there (nan when there are none)
    kl: float  # mean, nats
    max_entropy_error: float
    entropy_error: float  # mean

    @classmethod
    def of(cls, ref_logits, logits, ref_entropy, entropy) -> Agreement:
        """Logits (…, vocab) and entropies (any matching shape) of fp32 and the file at the same positions (float64
        in torch: its log-softmax over a 49K vocabulary is ~4× numpy's)."""
        import torch

        ref = torch.as_tensor(np.asarray(ref_logits)).reshape(-1, np.shape(ref_logits)[-1]).double()
        got = torch.as_tensor(np.asarray(logits)).reshape(ref.shape).double()
        log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
        p = log_p.exp()
        same = ref.argmax(-1) == got.argmax(-1)
        confident = p.amax(-1) >= CONFIDENT
        d_entropy = np.abs(np.asarray(ref_entropy, np.float64) - np.asarray(entropy, np.float64))
        return cls(
            positions=len(ref),
            max_logit_error=float((ref - got).abs().max()),
            top1=float(same.double().mean()),
            confident=int(confident.sum()),
            confident_top1=float(same[confident].double().mean()) if confident.any() else float("nan"),
            kl=float((p * (log_p - log_q)).sum(-1).mean()),
            max_entropy_error=float(d_entropy.max()),
            entropy_error=float(d_entropy.mean()),
        )

    def problems(self, bound: Bound) -> list[str]:
        """What is outside `bound` (NaN fails every comparison); empty when the file is within it."""
        out = []
        if not self.kl <= bound.kl:
            out.append(f"mean KL {self.kl:.2e} > {bound.kl:.0e}")
        if self.confident and not self.confident_top1 >= bound.top1:
            out.append(f"top-1 agreement {self.confident_top1:.1%} < {bound.top1:.0%} at confident positions")
        if not self.entropy_error <= bound.entropy:
            out.append(f"mean |Δ entropy| {self.entropy_error:.2e} > {bound.entropy:.0e}")
        return out
