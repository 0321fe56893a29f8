"""Rotary embeddings as one node: the rotate-half RoPE a traced model spells in six nodes per tensor becomes ONNX's
`RotaryEmbedding` (opset 23).

torch.onnx writes `x · cos + rotate_half(x) · sin` as it is computed — two Slices, a Neg, a Concat, two Muls and an
Add for each of a layer's queries and keys. At decode a step's tensors are a few hundred floats, so those twelve
nodes per layer cost their runtime's per-node overhead and little else. onnxscript's opset-23 fusions (the rewriter
torch.onnx itself is built on) recognise that pattern — a full rotation of a 4-D (batch, heads, sequence, head_dim)
tensor by the cosines and sines of a Concat of one angle tensor with itself — and write one node with the angles'
cosines and sines at half width; what does not match (partial or interleaved rotation, a cache indexed by position)
stays as traced. A file with no RoPE keeps its opset.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.passes import common
from onnxscript.rewriter import onnx_fusions

OPSET = 23  # the default domain's version once RotaryEmbedding is in the graph


def fuse(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` with each rotate-half RoPE of the main graph as one RotaryEmbedding, its default domain (graph and
    functions: a function must import the model's version, and every op the bodies use means the same at 23) at
    opset 23; `proto` itself when none matched. `count` tells how many."""
    imports = [i for g in [proto.opset_import, *(f.opset_import for f in proto.functions)] for i in g]
    default = [i for i in imports if i.domain in ("", "ai.onnx")]
    before = [i.version for i in default]
    for i in default:
        i.version = max(i.version, OPSET)
    model = ir.from_proto(proto)
    if onnx_fusions.fuse(model).get("RotaryEmbedding", 0) == 0:
        for i, version in zip(default, before, strict=True):
            i.version = version
        return proto
    common.CommonSubexpressionEliminationPass()(model)  # one Cos and one Sin of the angles for every layer
    common.RemoveUnusedNodesPass()(model)
    for node in model.graph:  # the new cosines and sines take their angles' type (the fp16 converter reads types)
        if node.op_type in ("Cos", "Sin") and node.outputs[0].type is None:
            node.outputs[0].type, node.outputs[0].shape = node.inputs[0].type, node.inputs[0].shape
    return ir.to_proto(model)


def count(proto: onnx.ModelProto) -> int:
    """RotaryEmbedding nodes in the main graph."""
    return sum(n.op_type == "RotaryEmbedding" and n.domain in ("", "ai.onnx") for n in proto.graph.node)
