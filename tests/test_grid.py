"""Weights already on a quantization grid (a quantized GGUF's, dequantized) written as MatMulNBits exactly
(exporter/grid.py): llama.cpp's Q4_1, Q4_0 and Q8_0 blocks are found and reproduced; anything else is left to the
quantizer. The real model's Q4_1 file: tests/test_real_model.py."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from sharp.exporter import grid
from sharp.exporter.cli import gguf_weights
from sharp.exporter.precision import quantize

K, N, BLOCK = 96, 40, 32


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _dequantized(kind: str, seed: int = 0) -> np.ndarray:
    """A (K, N) MatMul weight as llama.cpp quantizes and gguf-py dequantizes it (fp16 scales, fp32 values)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K // BLOCK, BLOCK)).astype(np.float32) * 0.05
    if kind == "Q4_1":  # d·q + m, q in 0…15: d = (max − min) / 15, m = min
        m = _fp16(w.min(-1, keepdims=True))
        d = _fp16((w.max(-1, keepdims=True) - w.min(-1, keepdims=True)) / 15)
        out = d * np.clip(np.rint((w - m) / d), 0, 15) + m
    elif kind == "Q4_0":  # d·(q − 8): d = max / −8 (the value of largest magnitude, its sign kept)
        amax = np.take_along_axis(w, np.abs(w).argmax(-1)[..., None], -1)
        d = _fp16(amax / -8)
        out = d * (np.clip(np.rint(w / d + 8), 0, 15) - 8)
    else:  # Q8_0: d·q, q in −127…127, d = amax / 127
        d = _fp16(np.abs(w).max(-1, keepdims=True) / 127)
        out = d * np.rint(w / d)
    return np.ascontiguousarray(out.astype(np.float32).reshape(N, K).T)


def _run(weight_graph: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(weight_graph.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _matmul_graph(w: np.ndarray) -> onnx.ModelProto:
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", N])], [numpy_helper.from_array(w, "w")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(("kind", "bits", "corrected"), [("Q4_1", 4, True), ("Q4_0", 4, False), ("Q8_0", 8, False)])
def test_llama_cpp_blocks_are_found_and_written_exactly(kind, bits, corrected):
    w = _dequantized(kind)
    assert grid.find(w, 4, BLOCK) is None if bits == 8 else True
    found = grid.find(w, bits, BLOCK)
    assert found is not None and found.bits == bits and (found.offsets is not None) == corrected
    back = found.steps[..., None] * (found.codes.astype(np.float32) - (1 << (bits - 1)))
    if found.offsets is not None:
        back = back + found.offsets.T[..., None]
    assert np.abs(back.reshape(N, K).T - w).max() <= 1e-6 * np.abs(w).max()
    x = np.random.default_rng(1).standard_normal((2, 3, K)).astype(np.float32)
    exact = quantize(_matmul_graph(w), "int4", accuracy_level=0)  # fp32 dot products: the weights alone
    assert {n.op_type for n in exact.graph.node} >= {"MatMulNBits"}
    onnx.checker.check_model(exact, full_check=True)  # a valid file: the contrib domain imported
    assert np.abs(_run(exact, x) - x @ w).max() <= 1e-5
    fast = quantize(_matmul_graph(w), "int4")  # level 4, as served: int8 activations in the dot products
    assert np.abs(_run(fast, x) - x @ w).max() <= 2e-2 * np.abs(x @ w).max()


def test_weights_off_every_grid_are_left_to_the_quantizer():
    rng = np.random.default_rng(2)
    assert grid.find(rng.standard_normal((K, N)).astype(np.float32), 8, BLOCK) is None
    w = _dequantized("Q4_1")
    w[5, 7] += 1e-3 * np.abs(w).max()  # one value off its block's grid
    assert grid.find(w, 4, BLOCK) is None and grid.find(w, 8, BLOCK) is None
    assert grid.find(w[:, :], 4, 48) is None  # blocks that straddle two of llama.cpp's own


def test_a_quantized_gguf_exports_at_the_precision_of_its_blocks_by_default():
    assert gguf_weights({"Q4_1": 210, "F32": 61, "Q8_0": 1}) == "int4"
    assert gguf_weights({"Q8_0": 200, "F32": 61}) == "int8"
    assert gguf_weights({"F16": 200, "F32": 61}) == "fp32"
