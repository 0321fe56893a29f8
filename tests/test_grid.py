"""Weights already on a quantization grid (a quantized GGUF's, dequantized) written as MatMulNBits exactly
(exporter/grid.py): llama.cpp's Q4_1, Q4_0 and Q8_0 blocks are found and reproduced, Q4_1's offsets by
sharp::AddBlockOffsets (the native kernel and its standard-op body alike); anything else is left to the quantizer.
The real model's Q4_1 file: tests/test_real_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from sharp.exporter import grid, siblings
from sharp.exporter.cli import gguf_weights
from sharp.exporter.precision import fusion_key, quantize
from sharp.plugins.onnxruntime import library_path

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


def _session(proto: onnx.ModelProto, native: bool = False, profile: bool = False) -> ort.InferenceSession:
    """A session on `proto`: with sharp's op library (its kernels run sharp's ops) or without (their bodies do)."""
    options = ort.SessionOptions()
    if native:
        options.register_custom_ops_library(library_path())
    options.enable_profiling = profile
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(weight_graph: onnx.ModelProto, x: np.ndarray, native: bool = False) -> np.ndarray:
    return _session(weight_graph, native).run(None, {"x": x})[0]


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
    assert [n.op_type for n in exact.graph.node].count("AddBlockOffsets") == corrected
    for native in (False, True):  # the offsets' standard-op body, and sharp's kernel
        assert np.abs(_run(exact, x, native) - x @ w).max() <= 1e-5
    fast = quantize(_matmul_graph(w), "int4")  # level 4, as served: int8 activations in the dot products
    assert np.abs(_run(fast, x) - x @ w).max() <= 2e-2 * np.abs(x @ w).max()


def _offsets_graph(p_shape, x_shape, c_shape, c_type=TensorProto.FLOAT) -> onnx.ModelProto:
    node = helper.make_node(grid.OFFSETS, ["P", "X", "C"], ["Y"], domain=grid.DOMAIN, name="offsets")
    kinds = (("P", TensorProto.FLOAT, p_shape), ("X", TensorProto.FLOAT, x_shape), ("C", c_type, c_shape))
    inputs = [helper.make_tensor_value_info(name, t, shape) for name, t, shape in kinds]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(grid.DOMAIN, 1)],
        functions=[grid.offsets_function(18)],
    )


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize(("lead", "k", "n", "blocks"), [((2, 5), 96, 40, 3), ((7,), 64, 600, 4), ((1, 1), 576, 3, 18)])
def test_the_offsets_kernel_equals_its_body_and_the_formula(lead, k, n, blocks, half):
    """P + BlockSums(X) · C by sharp's kernel (several column strips when N > 256, fp16 C widened) and by the body."""
    rng = np.random.default_rng(3)
    p = rng.standard_normal((*lead, n)).astype(np.float32)
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    c = rng.standard_normal((blocks, n)).astype(np.float16 if half else np.float32)
    want = p + x.reshape(*lead, blocks, k // blocks).sum(-1).astype(np.float64) @ c.astype(np.float64)
    proto = _offsets_graph(["a"] * len(lead) + [n], ["a"] * len(lead) + [k], [blocks, n],
                           TensorProto.FLOAT16 if half else TensorProto.FLOAT)  # fmt: skip
    native = _session(proto, native=True, profile=True)
    got = native.run(None, {"P": p, "X": x, "C": c})[0]
    events = json.loads(Path(native.end_profiling()).read_text())
    ran = {e["args"].get("op_name") for e in events if e.get("cat") == "Node"}
    assert "AddBlockOffsets" in ran and "ReduceSum" not in ran  # the kernel ran, not the body
    body = _session(proto).run(None, {"P": p, "X": x, "C": c})[0]
    for y in (got, body):
        assert y.shape == p.shape and np.abs(y - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_the_offsets_kernel_names_what_is_wrong():
    session = _session(_offsets_graph(None, None, None), native=True)
    x, c = np.ones((1, 96), np.float32), np.ones((5, 8), np.float32)  # 96 columns are not 5 blocks
    with pytest.raises(Exception, match="AddBlockOffsets: X's last dimension 96 is not a multiple of C's 5 blocks"):
        session.run(None, {"P": np.ones((1, 8), np.float32), "X": x, "C": c})
    with pytest.raises(Exception, match="AddBlockOffsets: P has shape"):
        session.run(None, {"P": np.ones((2, 8), np.float32), "X": np.ones((1, 100), np.float32), "C": c})


def test_weights_off_every_grid_are_left_to_the_quantizer():
    rng = np.random.default_rng(2)
    assert grid.find(rng.standard_normal((K, N)).astype(np.float32), 8, BLOCK) is None
    w = _dequantized("Q4_1")
    w[5, 7] += 1e-3 * np.abs(w).max()  # one value off its block's grid
    assert grid.find(w, 4, BLOCK) is None and grid.find(w, 8, BLOCK) is None
    assert grid.find(w[:, :], 4, 48) is None  # blocks that straddle two of llama.cpp's own


def test_a_weight_searched_in_column_strips_gets_the_grid_of_one_search(monkeypatch):
    """Strips of 24 columns: Q4_0 columns (no offsets) beside Q4_1 ones, and a value off its grid in the last strip."""
    w = np.concatenate([_dequantized("Q4_0")[:, :30], _dequantized("Q4_1", seed=3)], 1)  # 70 columns
    whole = grid.find(w, 4, BLOCK)
    monkeypatch.setattr(grid, "STRIP", K * 24)
    strips = grid.find(w, 4, BLOCK)
    assert whole is not None and strips is not None and whole.offsets is not None
    for field in ("codes", "steps", "offsets"):
        assert np.array_equal(getattr(strips, field), getattr(whole, field)), field
    assert grid.find(np.ascontiguousarray(w[:, :30]), 4, BLOCK).offsets is None  # Q4_0 strips alone: no offsets
    w[5, 67] += 1e-3 * np.abs(w).max()  # past the 64 columns searched first
    assert grid.find(w, 4, BLOCK) is None


def test_a_quantized_gguf_exports_at_the_precision_of_its_blocks_by_default():
    assert gguf_weights({"Q4_1": 210, "F32": 61, "Q8_0": 1}) == "int4"
    assert gguf_weights({"Q8_0": 200, "F32": 61}) == "int8"
    assert gguf_weights({"F16": 200, "F32": 61}) == "fp32"


@pytest.mark.parametrize("v_on_grid", [True, False])
def test_int4_fuses_a_value_projection_already_on_a_4_bit_grid_with_its_siblings(v_on_grid):
    """int4 keeps value projections at 8 bits (precision.KEEP_8BIT) and so apart from q and k; a Q4_x GGUF's value
    projection is written at its own 4 bits, so q, k and v become one MatMul (one dispatch, one correction)."""
    rng = np.random.default_rng(4)
    weights = {m: _dequantized("Q4_1", seed=i) for i, m in enumerate(("q_proj", "k_proj", "v_proj"))}
    if not v_on_grid:
        weights["v_proj"] = rng.standard_normal((K, N)).astype(np.float32)
    nodes = []
    for module in weights:
        node = helper.make_node("MatMul", ["x", module], [f"y_{module}"], name=module)
        scopes = onnx.StringStringEntryProto(key="pkg.torch.onnx.name_scopes", value=str(["", module, "linear"]))
        node.metadata_props.append(scopes)
        nodes.append(node)
    outputs = [helper.make_tensor_value_info(f"y_{m}", TensorProto.FLOAT, None) for m in weights]
    inits = [numpy_helper.from_array(w, m) for m, w in weights.items()]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", K])
    proto = helper.make_model(helper.make_graph(nodes, "g", [x], outputs, inits))
    removed = siblings.fuse(proto, apart=fusion_key(proto, "int4"))
    assert removed == (2 if v_on_grid else 1)
