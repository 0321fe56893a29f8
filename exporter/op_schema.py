"""The `sharp::SharpAttention` op as ONNX sees it (docs/op.md): its one signature, its schema, the translation
of `torch.ops.sharp.attention` into a node, and the wrapper that makes a fallback body an overload of the op.

Everything about slots and attributes lives here once; the bodies (dense.py, streamed.py) are helper functions
in the private `sharp.fallback` domain with only the inputs their algorithm reads, and `op_function` wires
the op's fixed slots to them.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import AttributeProto, helper
from onnx.defs import OpSchema
from onnxscript import BOOL, FLOAT
from onnxscript.values import Op, Opset

from sharp.exporter.settings import OPSET, STREAMED_BLOCK
from sharp.models import registry

SHARP = Opset("sharp", 1)
FALLBACK = Opset("sharp.fallback", 1)
BODY_OPSET = OPSET  # the standard opset the bodies are written in

# Input slots, in order (docs/op.md): Q, K, V, key_mask, alibi_slopes, then the per-head parameter slots.
OP_INPUTS: tuple[str, ...] = (
    "Q",
    "K",
    "V",
    "key_mask",
    "alibi_slopes",
    "alpha",
    "query_scale",
    "ssa_n",
    "ssa_b",
    "ssmax_s",
)
OP_OUTPUTS: tuple[str, ...] = ("O", "entropy")

# Attributes: name → (type, default written into the function; None = the node always carries it).
OP_ATTRIBUTES: dict[str, tuple[int, object]] = {
    "norm": (AttributeProto.STRING, None),
    "causal": (AttributeProto.INT, None),
    "scale": (AttributeProto.FLOAT, None),
    "poly": (AttributeProto.FLOATS, None),
    "q_heads": (AttributeProto.INT, None),
    "kv_heads": (AttributeProto.INT, None),
    "threshold": (AttributeProto.FLOAT, 0.5),  # adaptive: entropy above which β applies
    "max_iters": (AttributeProto.INT, 30),  # entmax: cap on threshold refinement steps (they stop at convergence)
    "block_size": (AttributeProto.INT, STREAMED_BLOCK),  # streamed bodies: keys per Loop iteration
}


def _schema() -> OpSchema:
    """The op's schema, so graph capture can emit the node without inlining any body."""
    fp = OpSchema.FormalParameter
    types = {"Q": "T", "K": "T", "V": "T", "key_mask": "tensor(bool)"}
    inputs = [fp(name, types.get(name, "tensor(float)")) for name in OP_INPUTS]
    kinds = {
        AttributeProto.STRING: OpSchema.AttrType.STRING,
        AttributeProto.INT: OpSchema.AttrType.INT,
        AttributeProto.FLOAT: OpSchema.AttrType.FLOAT,
        AttributeProto.FLOATS: OpSchema.AttrType.FLOATS,
    }
    traced = ("norm", "causal", "scale", "poly")  # what the translation writes; finalize adds the rest
    attributes = [OpSchema.Attribute(n, kinds[OP_ATTRIBUTES[n][0]], "") for n in traced]
    return OpSchema(
        "SharpAttention",
        SHARP.domain,
        1,
        inputs=inputs,
        outputs=[fp("O", "T"), fp("entropy", "tensor(float)")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
        attributes=attributes,
    )


SHARP_ATTENTION = Op(SHARP, "SharpAttention", _schema())


def translate(
    q: FLOAT,
    k: FLOAT,
    v: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: bool,
    scale: float,
    poly: Sequence[float],
):
    """Translation of torch.ops.sharp.attention: one `sharp::SharpAttention` node (bodies attached later)."""
    tensors = (q, k, v, key_mask, alibi_slopes, alpha, query_scale, ssa_n, ssa_b, ssmax_s)
    return SHARP_ATTENTION(*tensors, norm=norm, causal=int(causal), scale=scale, poly=list(poly))


ONE = "one"  # an `op_function` input that stands for the constant 1.0 (e.g. λ of a norm without a query scale)


def op_function(norm: registry.Norm, body: str, inputs: Sequence[str], attributes: Sequence[str]) -> onnx.FunctionProto:
    """`(sharp, SharpAttention, overload=norm)`: the op's full signature, one node calling `body` (a function of
    the `sharp.fallback` domain) with the op inputs named in `inputs` (or ONE) and the op attributes in
    `attributes`, passed by reference."""
    nodes = [helper.make_node("Constant", [], [ONE], value_float=1.0)] if ONE in inputs else []
    call = helper.make_node(body, list(inputs), list(OP_OUTPUTS), domain=FALLBACK.domain)
    call.attribute.extend(helper.make_attribute_ref(a, OP_ATTRIBUTES[a][0]) for a in attributes)
    nodes.append(call)
    required = [n for n, (_, default) in OP_ATTRIBUTES.items() if default is None]
    defaults = [helper.make_attribute(n, d) for n, (_, d) in OP_ATTRIBUTES.items() if d is not None]
    return helper.make_function(
        SHARP.domain,
        "SharpAttention",
        list(OP_INPUTS),
        list(OP_OUTPUTS),
        nodes,
        [helper.make_opsetid("", BODY_OPSET), helper.make_opsetid(FALLBACK.domain, 1)],
        attributes=required,
        attribute_protos=defaults,
        overload=norm.name,
    )
