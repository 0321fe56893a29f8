"""Logits only where the caller reads them: the generation graph's `logits_to_keep` input (Hugging Face's name for
the same argument of a causal LM's forward).

A prefill chunk needs one row of logits — its last position's, for the next token — yet the graph computed the LM
head at every position, and on a small model that head is the widest MatMul there is (SmolLM2: 49,152 × 576, about
a fifth of a prefill's arithmetic, and a (chunk, vocabulary) array of fp32 written and thrown away). The input N
(int64, shape (1,)) slices the final hidden states to their last N positions before the head, so `logits` is
(batch, min(N, sequence), vocabulary); N = 0 keeps every position. A decode step or a prefill chunk feeds 1; prompt
log-probabilities and a batched prefill (rows that end at different columns) feed 0.

The files of `sharp-export` with a KV cache have the input; onnxruntime-genai packages do not (onnxruntime-genai
feeds only the inputs it knows: `remove` takes it out again) and neither does the TensorRT form (its traced I/O).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INPUT = "logits_to_keep"
KEPT = "kept_sequence"  # the logits' second dimension once sliced
_ZERO, _START, _END, _AXIS = "logits_to_keep_zero", "logits_to_keep_start", "logits_to_keep_end", "logits_to_keep_axis"
_KEPT = "kept_hidden"
_NODES = ("logits_to_keep_start", "logits_to_keep_slice")


def add(proto: onnx.ModelProto) -> bool:
    """Slice the LM head's input to its last `logits_to_keep` positions (in place). False, and the graph unchanged,
    when `logits` is not a MatMul's output (a head with more after it: nothing is sliced then)."""
    graph = proto.graph
    at = next((i for i, n in enumerate(graph.node) if "logits" in n.output), None)
    if at is None or graph.node[at].op_type != "MatMul" or graph.node[at].domain not in ("", "ai.onnx"):
        return False
    head = graph.node[at]
    hidden = head.input[0]
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([0], np.int64), _ZERO),
            numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), _END),
            numpy_helper.from_array(np.array([1], np.int64), _AXIS),
        ]
    )
    nodes = [
        helper.make_node("Sub", [_ZERO, INPUT], [_START], name=_NODES[0]),  # −N; −0 = 0: every position
        helper.make_node("Slice", [hidden, _START, _END, _AXIS], [_KEPT], name=_NODES[1]),
    ]
    head.input[0] = _KEPT
    for offset, node in enumerate(nodes):
        graph.node.insert(at + offset, node)
    graph.input.append(helper.make_tensor_value_info(INPUT, TensorProto.INT64, [1]))
    for vi in graph.output:
        if vi.name == "logits" and len(vi.type.tensor_type.shape.dim) == 3:
            vi.type.tensor_type.shape.dim[1].dim_param = KEPT
    return True


def remove(proto: onnx.ModelProto) -> None:
    """The graph as `add` found it: the head reads the whole hidden state, and the input is gone (in place)."""
    graph = proto.graph
    slicer = next((n for n in graph.node if n.name == _NODES[1]), None)
    if slicer is None:
        return
    for node in graph.node:
        node.input[:] = [slicer.input[0] if i == _KEPT else i for i in node.input]
    keep = [n for n in graph.node if n.name not in _NODES]
    del graph.node[:]
    graph.node.extend(keep)
    inits = [i for i in graph.initializer if i.name not in (_ZERO, _END, _AXIS)]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    inputs = [i for i in graph.input if i.name != INPUT]
    del graph.input[:]
    graph.input.extend(inputs)
    for vi in graph.output:
        if vi.name == "logits" and len(vi.type.tensor_type.shape.dim) == 3:
            vi.type.tensor_type.shape.dim[1].dim_param = "sequence"


def feed(inputs: list[str], keep: int) -> dict[str, np.ndarray]:
    """The input's entry for a run of a graph whose input names are `inputs` (nothing for a file without it)."""
    return {INPUT: np.array([keep], np.int64)} if INPUT in inputs else {}
