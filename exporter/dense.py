"""Dense fallback bodies: the (B, Hq, Lq, Lk) logits are materialised, then normalised in one go.

One body per algorithm of the registry (a softmax-family transform, or the entmax family); each takes only
the inputs it reads, and `op_schema.op_function` wires the op's slots to it.
"""

from onnxscript import BOOL, FLOAT, script
from onnxscript import opset18 as op

from sharp.exporter.body_parts import (
    AdaptiveBeta,
    BlockLogits,
    EntmaxShifted,
    MaskedSoftmax,
    PLogP,
    RepeatKV,
    SignedLog,
    ThresholdStart,
    VisibleCount,
)
from sharp.exporter.op_schema import FALLBACK


@script(FALLBACK, default_opset=op)
def Logits(Q: FLOAT, K: FLOAT, key_mask: BOOL, alibi_slopes: FLOAT, scale: float, causal: int) -> tuple[FLOAT, BOOL]:
    """All logits at once."""
    start = op.Constant(value_ints=[0])
    z, visible = BlockLogits(
        Q, K, key_mask, alibi_slopes, start, op.Shape(K, start=2, end=3), scale=scale, causal=causal
    )
    return z, visible


@script(FALLBACK, default_opset=op)
def Finish(P: FLOAT, V: FLOAT, Q: FLOAT) -> tuple[FLOAT, FLOAT]:
    """Output P·V and the row entropy −Σ p log p."""
    out = op.MatMul(P, RepeatKV(V, Q))
    return out, op.Neg(op.Squeeze(PLogP(P), op.Constant(value_ints=[-1])))


@script(FALLBACK, default_opset=op)
def DenseSoftmax(
    Q: FLOAT, K: FLOAT, V: FLOAT, key_mask: BOOL, alibi_slopes: FLOAT, scale: float, causal: int
) -> tuple[FLOAT, FLOAT]:
    """t = z."""
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    out, ent = Finish(MaskedSoftmax(z, visible), V, Q)
    return out, ent


@script(FALLBACK, default_opset=op)
def DenseLogNScale(
    Q: FLOAT, K: FLOAT, V: FLOAT, key_mask: BOOL, alibi_slopes: FLOAT, ssmax_s: FLOAT, scale: float, causal: int
) -> tuple[FLOAT, FLOAT]:
    """t = s · log(n_visible) · z."""
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    s = op.Reshape(ssmax_s, op.Constant(value_ints=[1, -1, 1, 1]))
    t = op.Mul(op.Mul(s, op.Log(VisibleCount(visible))), z)
    out, ent = Finish(MaskedSoftmax(t, visible), V, Q)
    return out, ent


@script(FALLBACK, default_opset=op)
def DenseSignedLog(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    scale: float,
    causal: int,
) -> tuple[FLOAT, FLOAT]:
    """t = sgn(z) · n · log1p(b |z|)."""
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    out, ent = Finish(MaskedSoftmax(SignedLog(z, visible, ssa_n, ssa_b), visible), V, Q)
    return out, ent


@script(FALLBACK, default_opset=op)
def DenseEntropyBeta(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    scale: float,
    causal: int,
    poly: list[float],
    threshold: float,
) -> tuple[FLOAT, FLOAT]:
    """t = β(H) · z with H the entropy of softmax(z)."""
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    zs = op.Where(visible, z, op.Constant(value_float=0.0))
    h = op.Neg(PLogP(MaskedSoftmax(zs, visible)))
    beta = AdaptiveBeta(h, poly=poly, threshold=threshold)
    out, ent = Finish(MaskedSoftmax(op.Mul(beta, zs), visible), V, Q)
    return out, ent


@script(FALLBACK, default_opset=op)
def DenseEntmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    scale: float,
    causal: int,
    max_iters: int,
) -> tuple[FLOAT, FLOAT]:
    """α-entmax of λ z: τ by `max_iters` halvings of its bracket. With every logit materialised, one halving is
    one cheap pass, and measured faster here than the streamed body's Halley/Newton steps (three sums a pass)."""
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    one = op.Constant(value_float=1.0)
    zero = op.Constant(value_float=0.0)
    half = op.Constant(value_float=0.5)
    am1 = op.Sub(op.Reshape(alpha, op.Constant(value_ints=[1, -1, 1, 1])), one)
    inv = op.Div(one, am1)
    u = EntmaxShifted(z, visible, am1, query_scale)
    m = op.ReduceMax(u, op.Constant(value_ints=[-1]), keepdims=1)
    u = op.Sub(u, op.Where(op.IsInf(m), zero, m))
    lo, hi = ThresholdStart(VisibleCount(visible), am1)
    for _ in range(op.Constant(value_int=max_iters)):
        mid = op.Mul(op.Add(lo, hi), half)
        s = op.ReduceSum(op.Pow(op.Relu(op.Sub(u, mid)), inv), op.Constant(value_ints=[-1]), keepdims=1)
        big = op.GreaterOrEqual(s, one)
        lo = op.Where(big, mid, lo)
        hi = op.Where(big, hi, mid)
    tau = op.Mul(op.Add(lo, hi), half)
    w = op.Where(visible, op.Pow(op.Relu(op.Sub(u, tau)), inv), zero)
    total = op.ReduceSum(w, op.Constant(value_ints=[-1]), keepdims=1)
    p = op.Div(w, op.Where(op.Greater(total, zero), total, one))
    out, ent = Finish(p, V, Q)
    return out, ent


HELPERS = (Logits, Finish)
