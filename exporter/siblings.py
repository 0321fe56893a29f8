"""Sibling projections as one MatMul: the MatMuls that read the same activation through constant weights (a layer's
query, key and value projections; its MLP's gate and up) become one MatMul over the weights concatenated along N,
followed by a Split into the original outputs.

At decode a projection is a matrix-vector product over a few hundred floats, so each node is mostly its runtime's
per-node cost — a dispatch to the thread pool and a join — rather than arithmetic. One wider product streams the same
weights with one dispatch (onnxruntime-genai's builder writes packed QKV and gate-up projections for the same reason).
The values are unchanged: each output column is the same dot product as before.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _uses(proto: onnx.ModelProto) -> Counter:
    """How often each value name is read: by the main graph's nodes (and their subgraphs), graph outputs and the
    functions' bodies (an initializer a function reads is captured by name)."""
    uses: Counter = Counter(o.name for o in proto.graph.output)
    nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
    while nodes:
        n = nodes.pop()
        uses.update(i for i in n.input if i)
        nodes += [m for a in n.attribute if a.type == onnx.AttributeProto.GRAPH for m in a.g.node]
    return uses


def fuse(proto: onnx.ModelProto, apart: Callable[[onnx.NodeProto], object] = lambda node: None) -> int:
    """Fuse, in place, each group of two or more main-graph MatMuls that read the same A through 2-D initializers of
    the same dtype and K, each read by that MatMul alone; `apart(node)` splits a group further (nodes that must stay
    separable — e.g. weights a quantizer treats differently — return different keys). Returns the MatMuls
    removed."""
    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    uses = _uses(proto)
    nodes = list(graph.node)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for at, n in enumerate(nodes):
        w = inits.get(n.input[1]) if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") else None
        if w is not None and len(w.dims) == 2 and uses[w.name] == 1:
            groups[(n.input[0], w.data_type, w.dims[0], apart(n))].append(at)
    replace: dict[int, list[onnx.NodeProto]] = {}  # node index → what takes its place ([] for a fused member)
    dropped: set[str] = set()
    removed = 0
    for members in (g for g in groups.values() if len(g) > 1):
        first = nodes[members[0]]
        weights = [numpy_helper.to_array(inits[nodes[m].input[1]]) for m in members]
        name = f"{first.name}_siblings"
        packed = numpy_helper.from_array(np.concatenate(weights, axis=1), f"{first.input[1]}_siblings")
        widths = numpy_helper.from_array(np.array([w.shape[1] for w in weights], np.int64), f"{name}_widths")
        matmul = helper.make_node("MatMul", [first.input[0], packed.name], [f"{name}_out"], name=name)
        matmul.metadata_props.extend(first.metadata_props)  # the module it came from: the quantizer reads it
        outputs = [nodes[m].output[0] for m in members]
        split = helper.make_node("Split", [matmul.output[0], widths.name], outputs, name=f"{name}_split", axis=-1)
        # at the first member: A exists there, and every member's readers come after their own member
        replace |= {m: [] for m in members} | {members[0]: [matmul, split]}
        dropped.update(nodes[m].input[1] for m in members)
        graph.initializer.extend([packed, widths])
        removed += len(members) - 1
    if not replace:
        return 0
    kept = [new for at, n in enumerate(nodes) for new in replace.get(at, [n])]
    del graph.node[:]
    graph.node.extend(kept)
    kept_inits = [i for i in graph.initializer if i.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    return removed
