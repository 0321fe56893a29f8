"""Streamed fallback bodies: ONNX Loops over key blocks of `block_size` carrying the online state, so memory is
O(Lq · block) instead of O(Lq · Lk) — the algorithms of docs/attention.md, one body per registry algorithm.
"""

from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset18 as op

from sharp.exporter.body_parts import (
    AdaptiveBeta,
    BlockLogits,
    EntmaxShifted,
    EntropyFinish,
    PLogP,
    RepeatKV,
    SignedLog,
    ThresholdStart,
    ThresholdStep,
    ThresholdSums,
    VisibleKeys,
)
from sharp.exporter.op_schema import FALLBACK


@script(FALLBACK, default_opset=op)
def KeyBlock(K: FLOAT, V: FLOAT, key_mask: BOOL, i: INT64, block_size: int) -> tuple[FLOAT, FLOAT, BOOL, INT64]:
    """Block i of the keys, values and key mask, and its first key index (1-D)."""
    size = op.Reshape(op.Constant(value_int=block_size), op.Constant(value_ints=[1]))
    start = op.Mul(op.Reshape(i, op.Constant(value_ints=[1])), size)
    stop = op.Min(op.Add(start, size), op.Shape(K, start=2, end=3))
    axis2 = op.Constant(value_ints=[2])
    kb = op.Slice(K, start, stop, axis2)
    vb = op.Slice(V, start, stop, axis2)
    mb = op.Slice(key_mask, start, stop, op.Constant(value_ints=[1]))
    return kb, vb, mb, start


@script(FALLBACK, default_opset=op)
def BlockCount(K: FLOAT, block_size: int) -> INT64:
    size = op.Constant(value_int=block_size)
    lk = op.Squeeze(op.Shape(K, start=2, end=3))
    return op.Div(op.Sub(op.Add(lk, size), op.Constant(value_int=1)), size)


@script(FALLBACK, default_opset=op)
def RowState(Q: FLOAT, fill: float) -> FLOAT:
    """A (B, Hq, Lq, 1) tensor of `fill`."""
    shape = op.Concat(op.Shape(Q, start=0, end=3), op.Constant(value_ints=[1]), axis=0)
    return op.Expand(op.Constant(value_float=fill), shape)


@script(FALLBACK, default_opset=op)
def RowAccumulator(Q: FLOAT, V: FLOAT) -> FLOAT:
    """A (B, Hq, Lq, Dv) tensor of zeros."""
    shape = op.Concat(op.Shape(Q, start=0, end=3), op.Shape(V, start=3), axis=0)
    return op.Expand(op.Constant(value_float=0.0), shape)


@script(FALLBACK, default_opset=op)
def OnlineStep(M: FLOAT, L: FLOAT, KP: FLOAT, T: FLOAT, visible: BOOL) -> tuple[FLOAT, FLOAT, FLOAT, FLOAT, FLOAT]:
    """Fold one tile of transformed logits into (m, Λ, K' = Σe^{t−m}(t−m)); also the rescale r and weights e."""
    zero = op.Constant(value_float=0.0)
    t = op.Where(visible, T, op.Constant(value_float=float("-inf")))
    m_new = op.Max(M, op.ReduceMax(t, op.Constant(value_ints=[-1]), keepdims=1))
    m_safe = op.Where(op.IsInf(m_new), zero, m_new)
    r = op.Exp(op.Sub(M, m_safe))
    e = op.Where(visible, op.Exp(op.Sub(t, m_safe)), zero)
    rel = op.Where(visible, op.Sub(t, m_safe), zero)
    dm = op.Where(op.Greater(L, zero), op.Sub(M, m_safe), zero)
    kp = op.Add(
        op.Mul(r, op.Add(KP, op.Mul(L, dm))), op.ReduceSum(op.Mul(e, rel), op.Constant(value_ints=[-1]), keepdims=1)
    )
    lam = op.Add(op.Mul(r, L), op.ReduceSum(e, op.Constant(value_ints=[-1]), keepdims=1))
    return m_new, lam, kp, r, e


@script(FALLBACK, default_opset=op)
def StreamRowScaled(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    row_factor: FLOAT,
    scale: float,
    causal: int,
    block_size: int,
) -> tuple[FLOAT, FLOAT]:
    """Online softmax over t = row_factor · z (softmax, ssmax, adaptive's second pass)."""
    lk = op.Shape(K, start=2, end=3)
    m = RowState(Q, fill=float("-inf"))
    lam = RowState(Q, fill=0.0)
    kp = RowState(Q, fill=0.0)
    acc = RowAccumulator(Q, V)
    for i in range(BlockCount(K, block_size=block_size)):
        kb, vb, mb, start = KeyBlock(K, V, key_mask, i, block_size=block_size)
        z, visible = BlockLogits(Q, kb, mb, alibi_slopes, start, lk, scale=scale, causal=causal)
        t = op.Mul(row_factor, op.Where(visible, z, op.Constant(value_float=0.0)))
        m, lam, kp, r, e = OnlineStep(m, lam, kp, t, visible)
        acc = op.Add(op.Mul(r, acc), op.MatMul(e, RepeatKV(vb, Q)))
    live = op.Greater(lam, op.Constant(value_float=0.0))
    out = op.Div(acc, op.Where(live, lam, op.Constant(value_float=1.0)))
    return out, EntropyFinish(lam, kp)


@script(FALLBACK, default_opset=op)
def StreamedSignedLog(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    scale: float,
    causal: int,
    block_size: int,
) -> tuple[FLOAT, FLOAT]:
    """Online softmax over t = sgn(z) · n · log1p(b |z|) (SSA)."""
    lk = op.Shape(K, start=2, end=3)
    m = RowState(Q, fill=float("-inf"))
    lam = RowState(Q, fill=0.0)
    kp = RowState(Q, fill=0.0)
    acc = RowAccumulator(Q, V)
    for i in range(BlockCount(K, block_size=block_size)):
        kb, vb, mb, start = KeyBlock(K, V, key_mask, i, block_size=block_size)
        z, visible = BlockLogits(Q, kb, mb, alibi_slopes, start, lk, scale=scale, causal=causal)
        m, lam, kp, r, e = OnlineStep(m, lam, kp, SignedLog(z, visible, ssa_n, ssa_b), visible)
        acc = op.Add(op.Mul(r, acc), op.MatMul(e, RepeatKV(vb, Q)))
    live = op.Greater(lam, op.Constant(value_float=0.0))
    out = op.Div(acc, op.Where(live, lam, op.Constant(value_float=1.0)))
    return out, EntropyFinish(lam, kp)


@script(FALLBACK, default_opset=op)
def StreamedSoftmax(
    Q: FLOAT, K: FLOAT, V: FLOAT, key_mask: BOOL, alibi_slopes: FLOAT, scale: float, causal: int, block_size: int
) -> tuple[FLOAT, FLOAT]:
    """t = z."""
    one = op.Constant(value_float=1.0)
    out, ent = StreamRowScaled(Q, K, V, key_mask, alibi_slopes, one, scale=scale, causal=causal, block_size=block_size)
    return out, ent


@script(FALLBACK, default_opset=op)
def StreamedLogNScale(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    ssmax_s: FLOAT,
    scale: float,
    causal: int,
    block_size: int,
) -> tuple[FLOAT, FLOAT]:
    """t = s · log(n_visible) · z."""
    s = op.Reshape(ssmax_s, op.Constant(value_ints=[1, -1, 1, 1]))
    factor = op.Mul(s, op.Log(VisibleKeys(Q, K, key_mask, causal=causal)))
    out, ent = StreamRowScaled(
        Q, K, V, key_mask, alibi_slopes, factor, scale=scale, causal=causal, block_size=block_size
    )
    return out, ent


@script(FALLBACK, default_opset=op)
def StreamedEntropyBeta(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    scale: float,
    causal: int,
    poly: list[float],
    threshold: float,
    block_size: int,
) -> tuple[FLOAT, FLOAT]:
    """Pass 1 streams (m, Λ, K') of z without V → H → β; pass 2 is online softmax over β · z."""
    lk = op.Shape(K, start=2, end=3)
    m = RowState(Q, fill=float("-inf"))
    lam = RowState(Q, fill=0.0)
    kp = RowState(Q, fill=0.0)
    for i in range(BlockCount(K, block_size=block_size)):
        kb, _vb, mb, start = KeyBlock(K, K, key_mask, i, block_size=block_size)
        z, visible = BlockLogits(Q, kb, mb, alibi_slopes, start, lk, scale=scale, causal=causal)
        m, lam, kp, _r, _e = OnlineStep(m, lam, kp, z, visible)
    h = op.Unsqueeze(EntropyFinish(lam, kp), [-1])
    beta = AdaptiveBeta(h, poly=poly, threshold=threshold)
    out, ent = StreamRowScaled(Q, K, V, key_mask, alibi_slopes, beta, scale=scale, causal=causal, block_size=block_size)
    return out, ent


@script(FALLBACK, default_opset=op)
def StreamedEntmax(
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
    block_size: int,
) -> tuple[FLOAT, FLOAT]:
    """Entmax of λ z over key blocks: a max pass, threshold passes (safeguarded Halley/Newton, until every row
    converges, at most max_iters), and an output pass with Σ w, Σ w log w and Σ w v."""
    lk = op.Shape(K, start=2, end=3)
    zero = op.Constant(value_float=0.0)
    one = op.Constant(value_float=1.0)
    am1 = op.Sub(op.Reshape(alpha, op.Constant(value_ints=[1, -1, 1, 1])), one)
    inv = op.Div(one, am1)
    blocks = BlockCount(K, block_size=block_size)
    umax = RowState(Q, fill=float("-inf"))
    for i in range(blocks):
        kb, _vb, mb, start = KeyBlock(K, K, key_mask, i, block_size=block_size)
        z, visible = BlockLogits(Q, kb, mb, alibi_slopes, start, lk, scale=scale, causal=causal)
        u = EntmaxShifted(z, visible, am1, query_scale)
        umax = op.Max(umax, op.ReduceMax(u, op.Constant(value_ints=[-1]), keepdims=1))
    umax = op.Where(op.IsInf(umax), zero, umax)
    lo, hi = ThresholdStart(VisibleKeys(Q, K, key_mask, causal=causal), am1)
    tau = lo
    passes = op.Constant(value_int=0)
    go = op.Constant(value=True)
    while go:
        s0 = op.Mul(lo, zero)
        s1 = op.Mul(lo, zero)
        s2 = op.Mul(lo, zero)
        for j in range(blocks):
            kb2, _vb2, mb2, start2 = KeyBlock(K, K, key_mask, j, block_size=block_size)
            z2, visible2 = BlockLogits(Q, kb2, mb2, alibi_slopes, start2, lk, scale=scale, causal=causal)
            b0, b1, b2 = ThresholdSums(op.Sub(EntmaxShifted(z2, visible2, am1, query_scale), umax), tau, inv)
            s0 = op.Add(s0, b0)
            s1 = op.Add(s1, b1)
            s2 = op.Add(s2, b2)
        tau, lo, hi, done = ThresholdStep(tau, lo, hi, s0, s1, s2, inv)
        passes = op.Add(passes, op.Constant(value_int=1))
        go = op.And(op.Not(done), op.Less(passes, op.Constant(value_int=max_iters)))
    zsum = op.Mul(lo, zero)
    wlogw = op.Mul(lo, zero)
    acc = RowAccumulator(Q, V)
    for k in range(blocks):
        kb3, vb3, mb3, start3 = KeyBlock(K, V, key_mask, k, block_size=block_size)
        z3, visible3 = BlockLogits(Q, kb3, mb3, alibi_slopes, start3, lk, scale=scale, causal=causal)
        u3 = op.Sub(EntmaxShifted(z3, visible3, am1, query_scale), umax)
        w = op.Where(visible3, op.Pow(op.Relu(op.Sub(u3, tau)), inv), zero)
        zsum = op.Add(zsum, op.ReduceSum(w, op.Constant(value_ints=[-1]), keepdims=1))
        wlogw = op.Add(wlogw, PLogP(w))
        acc = op.Add(acc, op.MatMul(w, RepeatKV(vb3, Q)))
    out = op.Div(acc, op.Where(op.Greater(zsum, zero), zsum, one))
    return out, EntropyFinish(zsum, wlogw)


HELPERS = (KeyBlock, BlockCount, RowState, RowAccumulator, OnlineStep, StreamRowScaled)
