"""The op's cache form (docs/op.md, "The cache form"): each layer's KV cache written in place by its attention node.

torch.onnx writes a layer's cache as `present = Concat(past, new)`, read by the attention node: every decode step
copies the whole cache once more. The cache form moves that write into the node: it takes this step's keys and
values (slots 1–2), the past buffers and the number of valid past keys W (slots 10–12), writes the new keys at
[W, W + L) and returns the buffers as its presents (outputs 2–3), which a runtime may bind to the pasts' own memory
(onnxruntime's I/O binding, onnxruntime-genai's shared past/present) so that a step copies nothing. Fed a past of
exactly W keys, as any plain run feeds it, it computes what the Concat did.

W is the same for every row — the running batch is left-padded and right-aligned, as before — and is read from the
graph's own inputs: attention_mask's width (past + new) minus input_ids' (new).

The cache may be kept in fp16 (`sharp-export --kv-cache-dtype fp16`): half the bytes a decode step reads, for keys
rounded to fp16 once, when they are written.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import helper

from sharp.exporter import fallback
from sharp.exporter.op_schema import OP_INPUTS, OP_OUTPUTS, SHARP
from sharp.exporter.settings import KV_TYPES
from sharp.models.registry import Family, Norm

CACHE_INPUTS = ("past_key", "past_value", "past_length")
CACHE_OUTPUTS = ("present_key", "present_value")
# The key summary of the entmax family's cache form (docs/op.md): per page of PAGE keys the keys' minima and maxima,
# from which a decode step bounds a page's logits and skips the pages that provably get no weight.
SUMMARY_INPUTS = ("past_key_summary", "summary_length")
SUMMARY_OUTPUTS = ("present_key_summary",)
PAGE = 16
PAST_LENGTH = "past_length"  # the graph value holding W
PREFIX = "cache."  # a cache-form node's overload: cache.<norm>
SUMMARY_PREFIX = "summary."  # with the key summary's slots: summary.<norm> (the entmax family)
_AXIS = 2  # keys


def overload(norm: str, summary: bool = False) -> str:
    return (SUMMARY_PREFIX if summary else PREFIX) + norm


def rewrite(proto: onnx.ModelProto) -> int:
    """Turn every attention node fed by `present.i = Concat(past_key_values.i, new)` into the cache form (the
    Concats go); returns the number of layers rewritten."""
    graph = proto.graph
    producer = {out: node for node in graph.node for out in node.output}
    dropped, count = set(), 0
    for node in graph.node:
        if node.domain != SHARP.domain or node.op_type != "SharpAttention":
            continue
        concats = [producer.get(node.input[slot]) for slot in (1, 2)]
        if not all(c is not None and _is_cache_concat(c) for c in concats):
            raise ValueError(f"attention node {node.name!r}: its K/V do not come from a past/new Concat")
        pasts = [c.input[0] for c in concats]
        node.input[1], node.input[2] = concats[0].input[1], concats[1].input[1]
        node.input.extend([""] * (len(OP_INPUTS) - len(node.input)))
        node.input.extend([*pasts, PAST_LENGTH])
        node.output.extend([concats[0].output[0], concats[1].output[0]])
        node.overload = overload(node.overload)
        dropped.update(c.output[0] for c in concats)
        count += 1
    if not count:
        return 0
    kept = []
    for n in graph.node:
        if n.output[0] not in dropped:
            kept.append(onnx.NodeProto())
            kept[-1].CopyFrom(n)
    width = [
        helper.make_node("Shape", ["attention_mask"], ["sharp_total_length"], start=1, end=2),
        helper.make_node("Shape", ["input_ids"], ["sharp_new_length"], start=1, end=2),
        helper.make_node("Sub", ["sharp_total_length", "sharp_new_length"], [PAST_LENGTH]),
    ]
    del graph.node[:]
    graph.node.extend([*width, *kept])
    for out in graph.output:  # a present is as long as its buffer: past_sequence, or more when it grows
        if out.name.startswith("present."):
            out.type.tensor_type.shape.dim[_AXIS].dim_param = "present_sequence"
    return count


_ONNX_TYPES = {"fp32": onnx.TensorProto.FLOAT, "fp16": onnx.TensorProto.FLOAT16}
KV_DTYPES = {name: _ONNX_TYPES[name] for name in KV_TYPES}  # --kv-cache-dtype


def store_as(proto: onnx.ModelProto, kv_dtype: str) -> None:
    """The cache's element type in a cache-form graph: every past input and present output as `kv_dtype` (the
    attention nodes, their only readers and writers, take either; a step's own keys stay fp32)."""
    for vi in (*proto.graph.input, *proto.graph.output):
        if vi.name.startswith(("past_key_values.", "present.")):
            vi.type.tensor_type.elem_type = KV_DTYPES[kv_dtype]


def _is_cache_concat(node: onnx.NodeProto) -> bool:
    axis = next((a.i for a in node.attribute if a.name == "axis"), None)
    return (
        node.op_type == "Concat"
        and len(node.input) == 2
        and node.input[0].startswith("past_key_values.")
        and node.output[0].startswith("present.")
        and axis in (_AXIS, _AXIS - 4)
    )


def functions(norms: Iterable[Norm], mode: str, summary: bool = False) -> list[onnx.FunctionProto]:
    """One `(sharp, SharpAttention, overload=cache.<norm>)` per norm: the write in standard ops, then the nodes of
    the norm's own overload of `mode` on the keys [0, W + L) — the fallback for runtimes without sharp's kernel
    (which copies: standard ops cannot write into an input). `summary`: instead, `summary.<norm>` for each norm of
    the entmax family, which also writes the key summary (an ONNX function's outputs are fixed, and a node may not
    leave one out, so the summary's slots make an overload of their own)."""
    if summary:
        return [_function(n, mode, True) for n in norms if n.family is Family.ENTMAX]
    return [_function(n, mode, False) for n in norms]


def _function(norm: Norm, mode: str, summary: bool) -> onnx.FunctionProto:
    nodes = [
        helper.make_node("Constant", [], [name], value_ints=[value])
        for name, value in (("zero", 0), ("last", 2**63 - 1), ("axis", _AXIS))
    ]
    nodes += [
        helper.make_node("Shape", ["K"], ["new"], start=_AXIS, end=_AXIS + 1),
        helper.make_node("Add", ["past_length", "new"], ["end"]),
    ]
    pairs = (("past_key", "K", "present_key", "keys"), ("past_value", "V", "present_value", "values"))
    for past, new, present, visible in pairs:  # the cache's type (fp32 or fp16) in, fp32 to the body
        nodes += [
            helper.make_node("Slice", [past, "zero", "past_length", "axis"], [f"{past}_before"]),
            helper.make_node("Slice", [past, "end", "last", "axis"], [f"{past}_after"]),
            helper.make_node("CastLike", [new, past], [f"{new}_stored"]),
            helper.make_node("Concat", [f"{past}_before", f"{new}_stored", f"{past}_after"], [present], axis=_AXIS),
            helper.make_node("Slice", [present, "zero", "end", "axis"], [f"{visible}_stored"]),
            helper.make_node("Cast", [f"{visible}_stored"], [visible], to=onnx.TensorProto.FLOAT),
        ]
    if summary:
        nodes += _summary_nodes()
    plain = fallback.op_overload(norm, mode)  # its nodes, reading the visible keys (a function cannot call it)
    renamed = {"K": "keys", "V": "values"}
    for node in plain.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[:] = [renamed.get(i, i) for i in node.input]
        nodes.append(copy)
    return helper.make_function(
        SHARP.domain,
        "SharpAttention",
        [*OP_INPUTS, *CACHE_INPUTS, *(SUMMARY_INPUTS if summary else ())],
        [*OP_OUTPUTS, *CACHE_OUTPUTS, *(SUMMARY_OUTPUTS if summary else ())],
        nodes,
        list(plain.opset_import),
        attributes=list(plain.attribute),
        attribute_protos=list(plain.attribute_proto),
        overload=overload(norm.name, summary),
    )


def _summary_nodes() -> list[onnx.NodeProto]:
    """present_key_summary in standard ops: the whole present buffer edge-padded to whole pages, reshaped to
    (B, Hkv, pages, PAGE, D), its minima and maxima over each page's keys. Each page's values bound every key of it
    in [0, W + L) — a page with columns past W + L is bounded over those too (looser than the kernel's, still a bound)
    — and the past summary is not read: the body recomputes every page (it copies the cache anyway)."""
    make = helper.make_node
    return [
        make("Constant", [], ["page"], value_ints=[PAGE]),
        make("Constant", [], ["one_page_less"], value_ints=[PAGE - 1]),
        make("Cast", ["present_key"], ["summary_keys"], to=onnx.TensorProto.FLOAT),
        make("Shape", ["present_key"], ["summary_head"], start=0, end=2),
        make("Shape", ["present_key"], ["summary_width"], start=_AXIS, end=_AXIS + 1),
        make("Shape", ["present_key"], ["summary_dim"], start=3, end=4),
        make("Add", ["summary_width", "one_page_less"], ["summary_rounded"]),
        make("Div", ["summary_rounded", "page"], ["summary_pages"]),
        make("Mul", ["summary_pages", "page"], ["summary_padded"]),
        make("Sub", ["summary_padded", "summary_width"], ["summary_pad"]),
        make("Constant", [], ["summary_pad_before"], value_ints=[0] * 6),
        make("Constant", [], ["summary_pad_dim"], value_ints=[0]),
        make("Concat", ["summary_pad_before", "summary_pad", "summary_pad_dim"], ["summary_pads"], axis=0),
        make("Pad", ["summary_keys", "summary_pads"], ["summary_whole"], mode="edge"),
        make("Concat", ["summary_head", "summary_pages", "page", "summary_dim"], ["summary_shape"], axis=0),
        make("Reshape", ["summary_whole", "summary_shape"], ["summary_paged"]),
        make("Constant", [], ["summary_keys_axis"], value_ints=[3]),
        make("ReduceMin", ["summary_paged", "summary_keys_axis"], ["summary_min"], keepdims=1),
        make("ReduceMax", ["summary_paged", "summary_keys_axis"], ["summary_max"], keepdims=1),
        make("Concat", ["summary_min", "summary_max"], ["present_key_summary"], axis=3),
    ]
