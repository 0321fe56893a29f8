"""Weights that already sit on a blockwise quantization grid, written as `MatMulNBits` exactly.

A model read from a quantized GGUF (models/gguf.py) carries weights that llama.cpp quantized: in every block of 32
along a row (the input dimension) a Q4_1 weight is d·q + m, q in 0…15 (Q4_0: d·(q − 8); Q8_0: d·q, q in −128…127),
dequantized to fp32. Quantizing those values again rounds them a second time — onto a grid offset from theirs, since
onnxruntime's zero point is an integer and Q4_1's m/d is not — and on SmolLM2 that costs int4 its check (mean KL
0.19, top-1 79%). Here each block's own grid is found instead (its step d from the gaps between its values, checked
to hold every value within fp32 rounding) and written as it is:

    y = AddBlockOffsets(MatMulNBits(x; q, d), x, C) = MatMulNBits(x; q, d) + BlockSums(x) · C,
    C[b, n] = m[n, b] + 2^(bits−1)·d[n, b]

MatMulNBits' default zero point (2^(bits−1): no zero-point tensor, the kernels' fast path — a float zero point, the
other exact form, runs ~50× slower on onnxruntime's CPU) gives d·(q − 2^(bits−1)); the block's offset comes back as
the block sums of x times C, a product 32× smaller than the layer's, in `sharp::AddBlockOffsets` (docs/op.md): one
node of sharp's op library, or, without it, its standard-op body (Reshape, ReduceSum, MatMul, Add). An integer zero
point of 0 would make C the block minimum m itself (fp16 in the GGUF, half the bytes), but the int8 activations of
accuracy level 4 then multiply uncentred weights: measured on SmolLM2, mean KL to the exact weights 0.016 against
0.004 this way. Blocks whose offset is a whole number of steps (Q4_0, Q8_0) need no C: when every block of a weight
has one, the correction is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from sharp.exporter.op_schema import SHARP

DOMAIN, OFFSETS = SHARP.domain, "AddBlockOffsets"  # the correction's op (docs/op.md; sharp's op library runs it)
REL_TOLERANCE = 4e-6  # a value off its block's grid by more than this × the block's largest |value| is not on it


@dataclass(frozen=True)
class Grid:
    """A (K, N) weight as MatMulNBits blocks: codes (N, blocks, block) in [0, 2^bits), steps (N, blocks), and the
    offsets C (blocks, N) — None when every block's offset is a whole number of steps."""

    bits: int
    block: int
    codes: np.ndarray
    steps: np.ndarray
    offsets: np.ndarray | None


STRIP = 1 << 20  # values of a weight searched at once: the search's float64 temporaries stay in cache (~2× faster)


def find(weight: np.ndarray, bits: int, block: int) -> Grid | None:
    """The grid of a MatMul weight (K, N) — blocks of `block` along K with at most 2^bits equally spaced values — or
    None when any block is off every such grid (then it was never quantized so, and is quantized as usual)."""
    k, n = weight.shape
    if k % block:
        return None
    if n > 64 and _find_strip(weight[:, :64], bits, block) is None:  # a few columns first: most weights fail at once
        return None
    width = max(1, STRIP // k)
    strips = []
    for start in range(0, n, width):  # columns are independent: a block lies within one column
        strip = _find_strip(weight[:, start : start + width], bits, block)
        if strip is None:
            return None
        strips.append(strip)
    if len(strips) == 1:
        return strips[0]
    offsets = None
    if any(s.offsets is not None for s in strips):
        offsets = np.concatenate(
            [s.offsets if s.offsets is not None else np.zeros(s.steps.shape[::-1], np.float32) for s in strips], 1
        )
    codes, steps = (np.concatenate([getattr(s, f) for s in strips]) for f in ("codes", "steps"))
    return Grid(bits, block, codes, steps, offsets)


def _find_strip(weight: np.ndarray, bits: int, block: int) -> Grid | None:
    k, n = weight.shape
    levels, mid = 1 << bits, 1 << (bits - 1)
    w = np.ascontiguousarray(weight.T, np.float64).reshape(-1, block)  # (N · blocks, block), row-major in N
    lo, hi = w.min(-1, keepdims=True), w.max(-1, keepdims=True)
    scale = np.maximum(np.abs(w).max(-1, keepdims=True), np.finfo(np.float32).tiny)
    # the step a quantizer chose: llama.cpp's Q4_1 spans its block ((max − min) / 15), Q8_0 and Q4_0 scale the
    # largest magnitude (amax / 127, amax / 8); else (computed only for the blocks those leave) the smallest gap
    # between values, or a fraction of it
    candidates = [lambda: (hi - lo) / (levels - 1), lambda: scale / (mid - 1), lambda: scale / mid]
    if bits == 8:  # Q8_0's first: a Q8_0 tensor (a quantized head) then takes one pass, not two
        candidates[:2] = candidates[1::-1]
    gap: list[np.ndarray] = []  # computed once, when first asked for
    smallest = lambda: gap[0] if gap else gap.append(_smallest_gap(w, scale)) or gap[0]
    candidates += [lambda j=j: smallest() / j for j in range(1, 9)]
    codes, fits, bases = np.zeros_like(w), np.zeros_like(lo), np.zeros_like(lo)
    todo = np.arange(len(w))
    for candidate in candidates:
        every = len(todo) == len(w)  # the first pass reads the arrays as they are (a gather copies all of w)
        x, low, step = (w, lo, candidate()) if every else (w[todo], lo[todo], candidate()[todo])
        step = np.where(np.isfinite(step) & (step > 0), step, 1.0)  # a constant block: any step
        c = np.rint((x - low) / step)
        mean_c, mean_w = c.mean(-1, keepdims=True), x.mean(-1, keepdims=True)
        spread = ((c - mean_c) ** 2).sum(-1, keepdims=True)
        slope = ((c - mean_c) * (x - mean_w)).sum(-1, keepdims=True) / np.maximum(spread, 1)
        fitted = np.where(spread > 0, slope, step)  # least squares: the step and offset that fit the codes best
        base = mean_w - fitted * mean_c
        good = (c.max(-1) <= levels - 1) & np.all(np.abs(base + fitted * c - x) <= REL_TOLERANCE * scale[todo], -1)
        done = todo[good]
        codes[done], fits[done], bases[done] = c[good], fitted[good], base[good]
        todo = todo[~good]
        if not len(todo):
            break
    if len(todo):
        return None
    # a block whose offset is a whole number of steps within the code range needs no correction; a negative step
    # (the codes reversed) aligns Q4_0's blocks, whose scale llama.cpp signs by the value of largest magnitude
    top = levels - 1
    flipped_bases, flipped_fits = bases + top * fits, -fits
    aligned = np.zeros_like(lo, bool)
    shift = np.zeros_like(lo)
    for flip in (False, True):
        b, f = (flipped_bases, flipped_fits) if flip else (bases, fits)
        least = top - codes.max(-1, keepdims=True) if flip else codes.min(-1, keepdims=True)
        most = top - codes.min(-1, keepdims=True) if flip else codes.max(-1, keepdims=True)
        whole = np.rint(b / f)
        fits_here = (np.abs(b / f - whole) * np.abs(f) <= REL_TOLERANCE * scale) & (whole + mid + least >= 0)
        fits_here &= whole + mid + most <= top
        use = fits_here & ~aligned
        if flip:
            codes = np.where(use, top - codes, codes)
            fits, bases = np.where(use, f, fits), np.where(use, b, bases)
        shift = np.where(use, whole + mid, shift)
        aligned |= fits_here
    codes = codes + shift
    offsets = np.where(aligned, 0.0, bases + mid * fits).reshape(n, k // block)
    return Grid(
        bits,
        block,
        codes.astype(np.uint8).reshape(n, k // block, block),
        fits.reshape(n, k // block).astype(np.float32),
        None if aligned.all() else offsets.T.astype(np.float32).copy(),
    )


def _smallest_gap(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    gaps = np.diff(np.sort(w, -1), axis=-1)
    return np.where(gaps > REL_TOLERANCE * 8 * scale, gaps, np.inf).min(-1, keepdims=True)


def _packed(grid: Grid) -> np.ndarray:
    """The codes as MatMulNBits' B: (N, blocks, block·bits/8) bytes, the first of two 4-bit codes in the low nibble."""
    if grid.bits == 8:
        return grid.codes
    return (grid.codes[..., 0::2] | (grid.codes[..., 1::2] << 4)).astype(np.uint8)


def offsets_function(opset: int) -> onnx.FunctionProto:
    """`sharp::AddBlockOffsets(P, X, C) = P + BlockSums(X) · C` in standard ops of `opset`: the body onnxruntime
    inlines when sharp's op library is not loaded (docs/op.md). The block length is K / C's rows."""
    nodes = [
        helper.make_node("Shape", ["X"], ["lead"], end=-1),
        helper.make_node("Shape", ["C"], ["blocks"], end=1),
        helper.make_node("Constant", [], ["last"], value_ints=[-1]),
        helper.make_node("Concat", ["lead", "blocks", "last"], ["blocked"], axis=0),
        helper.make_node("Reshape", ["X", "blocked"], ["x_blocks"]),
        helper.make_node("ReduceSum", ["x_blocks", "last"], ["sums"], keepdims=0),
        helper.make_node("Cast", ["C"], ["c"], to=onnx.TensorProto.FLOAT),
        helper.make_node("MatMul", ["sums", "c"], ["offset"]),
        helper.make_node("Add", ["P", "offset"], ["Y"]),
    ]
    return helper.make_function(DOMAIN, OFFSETS, ["P", "X", "C"], ["Y"], nodes, [helper.make_opsetid("", opset)])


def _declare_offsets(proto: onnx.ModelProto) -> None:
    """The file's AddBlockOffsets body and the domains its nodes need, once."""
    if any((f.domain, f.name) == (DOMAIN, OFFSETS) for f in proto.functions):
        return
    imports = {o.domain: o.version for o in proto.opset_import}
    proto.functions.append(offsets_function(imports.get("", imports.get("ai.onnx", 18))))
    if DOMAIN not in imports:
        proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def rewrite(proto: onnx.ModelProto, node: onnx.NodeProto, grid: Grid, accuracy_level: int) -> None:
    """Replace the MatMul `node` by MatMulNBits on `grid`, plus the offsets' correction."""
    graph = proto.graph
    x, w = node.input
    y = node.output[0]
    n_out, blocks = grid.steps.shape
    k = blocks * grid.block
    name = node.name or w
    inits = [numpy_helper.from_array(_packed(grid), f"{w}_Q{grid.bits}"),
             numpy_helper.from_array(grid.steps.reshape(-1), f"{w}_scales")]  # fmt: skip
    product = y if grid.offsets is None else f"{name}_nbits"
    nodes = [
        helper.make_node(
            "MatMulNBits", [x, inits[0].name, inits[1].name], [product], name=f"{name}_MatMulNBits",
            domain="com.microsoft", K=k, N=n_out, bits=grid.bits, block_size=grid.block,
            accuracy_level=accuracy_level,
        )
    ]  # fmt: skip
    if grid.offsets is not None:
        inits.append(numpy_helper.from_array(grid.offsets, f"{w}_offsets"))
        offsets = helper.make_node(OFFSETS, [product, x, f"{w}_offsets"], [y], name=f"{name}_offsets", domain=DOMAIN)
        nodes.append(offsets)
        _declare_offsets(proto)
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    at = list(graph.node).index(node)
    graph.node.remove(node)
    for i, new in enumerate(nodes):
        graph.node.insert(at + i, new)
    graph.initializer.extend(inits)
