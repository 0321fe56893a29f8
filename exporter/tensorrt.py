"""The TensorRT form of a sharp export (docs/tensorrt.md): every `sharp::SharpAttention` node rewritten into what
TensorRT's ONNX parser maps to sharp's AOT plugin, optionally with a fallback body that runs it elsewhere.

TensorRT's parser takes a node whose op_type is the plugin's name and whose `plugin_namespace` attribute is its
namespace; `aot=1` selects the ahead-of-time implementation. Plugins take no empty inputs, no bool inputs and no
float scalars, so the form has six fixed inputs — Q, K, V, the key mask as int32, every per-head parameter packed
into one fp32 vector (plus the adaptive polynomial), the per-query scale (or a constant 1) — and the attributes
the plugin reads. With fallback bodies, an overload `tensorrt.<norm>` unpacks the form and calls the norm's
standard overload, so ONNX Runtime (without sharp's native library, which takes only the standard form) runs it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sharp.exporter import fallback
from sharp.exporter.op_schema import OP_INPUTS, OP_OUTPUTS, SHARP
from sharp.exporter.settings import STREAMED_BLOCK
from sharp.models import registry
from sharp.plugins.tensorrt.plugin import INPUTS as PLUGIN_INPUTS
from sharp.plugins.tensorrt.plugin import PACKED_HEAD_PARAMS

OVERLOAD = "tensorrt"
NAMESPACE = "sharp"
# The node attributes the plugin declares (its register() signature); anything else would be refused by it.
PLUGIN_ATTRIBUTES = ("norm", "causal", "scale", "q_heads", "kv_heads", "poly")
FORM_INPUTS = ("Q", "K", "V", "key_mask_i32", "params", "query_scale")
assert len(FORM_INPUTS) == len(PLUGIN_INPUTS)


def _attr(node: onnx.NodeProto, name: str):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def is_tensorrt_form(proto: onnx.ModelProto) -> bool:
    return any(
        n.domain == SHARP.domain and n.op_type == "SharpAttention" and n.overload.startswith(OVERLOAD)
        for n in proto.graph.node
    )


def rewrite(proto: onnx.ModelProto, fallback_mode: str | None, block_size: int = STREAMED_BLOCK) -> onnx.ModelProto:
    """Rewrite every standard-form node (docs/op.md) into the TensorRT form, in place; returns `proto`. With a
    `fallback_mode` the file keeps its standard bodies and gains the form's (`tensorrt.<norm>` overloads)."""
    graph = proto.graph
    nodes: list[onnx.NodeProto] = []
    constants: dict[str, np.ndarray] = {}

    def constant(name: str, value: np.ndarray) -> str:
        constants.setdefault(name, value.astype(np.float32))
        return name

    norms = set()
    for i, node in enumerate(graph.node):
        if not (node.domain == SHARP.domain and node.op_type == "SharpAttention"):
            nodes.append(node)
            continue
        slots = dict(zip(OP_INPUTS, list(node.input) + [""] * (len(OP_INPUTS) - len(node.input)), strict=True))
        heads = _attr(node, "q_heads")
        poly = np.asarray(_attr(node, "poly"), dtype=np.float32)
        zeros = constant(f"sharp_trt_zeros_{heads}", np.zeros(heads))
        packed = [slots[name] or zeros for name in PACKED_HEAD_PARAMS]
        packed.append(constant(f"sharp_trt_poly_{i}", poly))
        mask_i32, params = f"{node.name or i}_key_mask_i32", f"{node.name or i}_params"
        nodes.append(helper.make_node("Cast", [slots["key_mask"]], [mask_i32], to=TensorProto.INT32))
        nodes.append(helper.make_node("Concat", packed, [params], axis=0))
        qscale = slots["query_scale"] or constant("sharp_trt_one", np.ones(1))
        outputs = list(node.output) + [""] * (len(OP_OUTPUTS) - len(node.output))
        outputs = [name or f"{node.name or i}_{OP_OUTPUTS[j]}_unused" for j, name in enumerate(outputs)]
        form = helper.make_node(
            "SharpAttention",
            [slots["Q"], slots["K"], slots["V"], mask_i32, params, qscale],
            outputs,
            name=node.name,
            domain=SHARP.domain,
            plugin_namespace=NAMESPACE,
            aot=1,
        )
        form.attribute.extend(a for a in node.attribute if a.name in PLUGIN_ATTRIBUTES)
        norm = _attr(node, "norm").decode()
        form.overload = f"{OVERLOAD}.{norm}"  # TensorRT ignores it (plugin_namespace wins); ONNX Runtime's fallback
        norms.add(norm)
        nodes.append(form)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in constants.items())
    if fallback_mode is not None:
        proto.functions.extend(fallback_functions(sorted(norms), fallback_mode, block_size))
    return proto


def fallback_functions(norms: list[str], mode: str, block_size: int) -> list[onnx.FunctionProto]:
    """`(sharp, SharpAttention, overload=tensorrt.<norm>)` per norm: unpack the form (H from Q's shape) and call
    the norm's fallback body of `mode` directly (ONNX Runtime does not resolve an overloaded call nested in a
    function)."""
    return [_fallback_function(registry.get(norm), mode, block_size) for norm in norms]


def _fallback_function(norm: registry.Norm, mode: str, block_size: int) -> onnx.FunctionProto:
    n = [
        helper.make_node("Shape", ["Q"], ["h"], start=1, end=2),
        helper.make_node("Constant", [], ["b0"], value_ints=[0]),
    ]
    for j in range(1, len(PACKED_HEAD_PARAMS) + 1):
        n.append(helper.make_node("Constant", [], [f"c{j}"], value_ints=[j]))
        n.append(helper.make_node("Mul", ["h", f"c{j}"], [f"b{j}"]))
    for j, name in enumerate(PACKED_HEAD_PARAMS):
        n.append(helper.make_node("Slice", ["params", f"b{j}", f"b{j + 1}"], [name]))
    n.append(helper.make_node("Cast", ["key_mask_i32"], ["key_mask"], to=TensorProto.BOOL))
    standard = fallback.op_overload(norm, mode)  # the standard overload's body, reading the unpacked slots
    n.extend(standard.node)
    defaults = {a.name: a for a in standard.attribute_proto}
    defaults["block_size"] = helper.make_attribute("block_size", block_size)
    return helper.make_function(
        SHARP.domain,
        "SharpAttention",
        list(FORM_INPUTS),
        list(OP_OUTPUTS),
        n,
        list(standard.opset_import),
        attributes=list(PLUGIN_ATTRIBUTES),
        attribute_protos=list(defaults.values()),
        overload=f"{OVERLOAD}.{norm.name}",
    )
