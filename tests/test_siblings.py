"""Sibling projections fused into one MatMul (exporter/siblings.py): same values, fewer nodes, and only what may be
fused is."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from sharp.exporter import siblings


def _graph(rng: np.random.Generator) -> onnx.ModelProto:
    """x feeds q (8→5), k (8→3), v (8→6), and s1 and s2 through one weight they share; y feeds p (8→2) alone."""
    weights = {f"w_{n}": rng.standard_normal(shape).astype(np.float32)
               for n, shape in {"q": (8, 5), "k": (8, 3), "v": (8, 6), "s": (8, 4), "p": (8, 2)}.items()}  # fmt: skip
    nodes = [
        helper.make_node("MatMul", ["x", "w_q"], ["q"], name="q"),
        helper.make_node("Relu", ["x"], ["y"], name="relu"),
        helper.make_node("MatMul", ["x", "w_k"], ["k"], name="k"),
        helper.make_node("MatMul", ["y", "w_p"], ["p"], name="p"),
        helper.make_node("MatMul", ["x", "w_s"], ["s1"], name="s1"),
        helper.make_node("MatMul", ["x", "w_v"], ["v"], name="v"),
        helper.make_node("MatMul", ["x", "w_s"], ["s2"], name="s2"),
        helper.make_node("Add", ["k", "k"], ["k2"], name="k_reader"),  # a reader between members
    ]
    outs = {"q": 5, "k2": 3, "v": 6, "p": 2, "s1": 4, "s2": 4}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", w]) for n, w in outs.items()],
        [numpy_helper.from_array(w, name) for name, w in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(proto: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x}), strict=True))


def test_siblings_fuse_into_one_matmul_with_the_same_values():
    rng = np.random.default_rng(0)
    proto = _graph(rng)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    before = _run(proto, x)
    assert siblings.fuse(proto) == 2  # q, k, v: three MatMuls become one
    kinds = [n.op_type for n in proto.graph.node]
    # q/k/v one MatMul + Split; p alone; s1 and s2 share their weight (each is read twice): left as they are
    assert kinds.count("MatMul") == 4 and kinds.count("Split") == 1
    assert {i.name for i in proto.graph.initializer} >= {"w_p", "w_s"}
    assert not {"w_q", "w_k", "w_v"} & {i.name for i in proto.graph.initializer}
    after = _run(proto, x)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert siblings.fuse(proto) == 0  # nothing left to fuse


@pytest.mark.parametrize("apart, removed", [(lambda n: n.name == "v", 1), (lambda n: n.name, 0)])
def test_what_must_stay_apart_stays_apart(apart, removed):
    rng = np.random.default_rng(1)
    proto = _graph(rng)
    x = rng.standard_normal((1, 4, 8)).astype(np.float32)
    before = _run(proto, x)
    assert siblings.fuse(proto, apart=apart) == removed
    assert [n.op_type for n in proto.graph.node].count("MatMul") == 6 - removed
    after = _run(proto, x)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
