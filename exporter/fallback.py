"""Standard-op bodies of `sharp::SharpAttention` (dense: the logits are materialised), one per norm.

Stock ONNX Runtime runs a file through these model-local functions; a registered kernel for
(sharp, SharpAttention) replaces them. ONNX functions cannot branch on a string attribute, so each norm has
its own body, stored as an *overload* of the one op (docs/op.md). Shared steps are helper functions in the
private domain `sharp.fallback`. Everything is computed in float32, in the order of docs/attention.md.
"""

from collections.abc import Sequence

import onnxscript
from onnx.defs import OpSchema
from onnxscript import BOOL, FLOAT, INT64
from onnxscript import opset18 as op
from onnxscript.values import Op, Opset

SHARP = Opset("sharp", 1)
FALLBACK = Opset("sharp.fallback", 1)


def _schema() -> OpSchema:
    """The op's schema (docs/op.md), so graph capture can emit the node without inlining any body."""
    fp = OpSchema.FormalParameter
    floats = ("alibi_slopes", "alpha", "query_scale", "ssa_n", "ssa_b", "ssmax_s")
    inputs = [fp(n, "T") for n in ("Q", "K", "V")] + [fp("key_mask", "tensor(bool)")]
    inputs += [fp(n, "tensor(float)") for n in floats]
    attr, kind = OpSchema.Attribute, OpSchema.AttrType
    attributes = [
        attr("norm", kind.STRING, ""),
        attr("causal", kind.INT, ""),
        attr("scale", kind.FLOAT, ""),
        attr("poly", kind.FLOATS, ""),
    ]
    return OpSchema(
        "SharpAttention",
        SHARP.domain,
        1,
        inputs=inputs,
        outputs=[fp("O", "T"), fp("entropy", "tensor(float)")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
        attributes=attributes,
    )


SHARP_ATTENTION = Op(SHARP, "SharpAttention", _schema())


def translate(
    q: FLOAT,
    k: FLOAT,
    v: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: bool,
    scale: float,
    poly: Sequence[float],
):
    """Translation of torch.ops.sharp.attention: one `sharp::SharpAttention` node (bodies attached later)."""
    return SHARP_ATTENTION(
        q,
        k,
        v,
        key_mask,
        alibi_slopes,
        alpha,
        query_scale,
        ssa_n,
        ssa_b,
        ssmax_s,
        norm=norm,
        causal=int(causal),
        scale=scale,
        poly=list(poly),
    )


@onnxscript.script(FALLBACK, default_opset=op)
def RepeatKV(X: FLOAT, Q: FLOAT) -> FLOAT:
    """GQA: (B, Hkv, L, D) → (B, Hq, L, D), query head h reading KV head h // (Hq / Hkv)."""
    b = op.Shape(X, start=0, end=1)
    hkv = op.Shape(X, start=1, end=2)
    rest = op.Shape(X, start=2)
    hq = op.Shape(Q, start=1, end=2)
    group = op.Div(hq, hkv)
    expanded = op.Expand(op.Unsqueeze(X, [2]), op.Concat(b, hkv, group, rest, axis=0))
    return op.Reshape(expanded, op.Concat(b, hq, rest, axis=0))


@onnxscript.script(FALLBACK, default_opset=op)
def BlockLogits(
    Q: FLOAT, K: FLOAT, key_mask: BOOL, alibi_slopes: FLOAT, k_start: INT64, lk: INT64, scale: float, causal: int
) -> tuple[FLOAT, BOOL]:
    """Logits of the keys [k_start, k_start + len(K)) of Lk: z = scale·q·kᵀ + slope·(j − P_i), P_i = Lk − Lq + i,
    and their visibility (causal, key_mask)."""
    k_rep = RepeatKV(K, Q)
    z = op.Mul(op.MatMul(Q, op.Transpose(k_rep, perm=[0, 1, 3, 2])), op.Constant(value_float=scale))
    lq = op.Shape(Q, start=2, end=3)
    lb = op.Shape(K, start=2, end=3)
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    qpos = op.Add(op.Range(zero, op.Squeeze(lq), one), op.Squeeze(op.Sub(lk, lq)))
    kpos = op.Add(op.Range(zero, op.Squeeze(lb), one), op.Squeeze(k_start))
    rel = op.Sub(op.Unsqueeze(kpos, [0]), op.Unsqueeze(qpos, [1]))  # (Lq, Lb) = j − P_i
    slopes = op.Reshape(alibi_slopes, op.Constant(value_ints=[1, -1, 1, 1]))
    z = op.Add(z, op.Mul(slopes, op.Cast(rel, to=1)))
    not_causal = op.Not(op.Cast(op.Constant(value_int=causal), to=9))
    visible = op.And(op.Or(not_causal, op.LessOrEqual(rel, zero)), op.Unsqueeze(key_mask, [1, 2]))
    return z, visible


@onnxscript.script(FALLBACK, default_opset=op)
def Logits(Q: FLOAT, K: FLOAT, key_mask: BOOL, alibi_slopes: FLOAT, scale: float, causal: int) -> tuple[FLOAT, BOOL]:
    """All logits at once (dense bodies)."""
    z, visible = BlockLogits(
        Q,
        K,
        key_mask,
        alibi_slopes,
        op.Constant(value_ints=[0]),
        op.Shape(K, start=2, end=3),
        scale=scale,
        causal=causal,
    )
    return z, visible


@onnxscript.script(FALLBACK, default_opset=op)
def MaskedSoftmax(T: FLOAT, visible: BOOL) -> FLOAT:
    """softmax over the last axis with masked entries exactly 0 and rows with nothing visible all 0."""
    neg_inf = op.Constant(value_float=float("-inf"))
    t = op.Where(visible, T, neg_inf)
    m = op.ReduceMax(t, op.Constant(value_ints=[-1]), keepdims=1)
    m = op.Where(op.IsInf(m), op.Constant(value_float=0.0), m)
    e = op.Where(visible, op.Exp(op.Sub(t, m)), op.Constant(value_float=0.0))
    s = op.ReduceSum(e, op.Constant(value_ints=[-1]), keepdims=1)
    return op.Div(e, op.Where(op.Greater(s, op.Constant(value_float=0.0)), s, op.Constant(value_float=1.0)))


@onnxscript.script(FALLBACK, default_opset=op)
def Finish(P: FLOAT, V: FLOAT, Q: FLOAT) -> tuple[FLOAT, FLOAT]:
    """Output P·V and the row entropy −Σ_{p>0} p log p."""
    out = op.MatMul(P, RepeatKV(V, Q))
    pos = op.Greater(P, op.Constant(value_float=0.0))
    plogp = op.Where(
        pos, op.Mul(P, op.Log(op.Where(pos, P, op.Constant(value_float=1.0)))), op.Constant(value_float=0.0)
    )
    ent = op.Neg(op.ReduceSum(plogp, op.Constant(value_ints=[-1]), keepdims=0))
    return out, ent


@onnxscript.script(FALLBACK, default_opset=op)
def VisibleCount(visible: BOOL) -> FLOAT:
    """Visible keys per row (B, H|1, Lq, 1), at least 1."""
    n = op.ReduceSum(op.Cast(visible, to=1), op.Constant(value_ints=[-1]), keepdims=1)
    return op.Max(n, op.Constant(value_float=1.0))


@onnxscript.script(FALLBACK, default_opset=op)
def EntmaxProbs(Z: FLOAT, visible: BOOL, alpha: FLOAT, max_iters: int) -> FLOAT:
    """α-entmax by bisection of τ on [max u − 1, max u − n^{1−α}], u = (α−1) z, then renormalised."""
    zero = op.Constant(value_float=0.0)
    one = op.Constant(value_float=1.0)
    am1 = op.Sub(op.Reshape(alpha, op.Constant(value_ints=[1, -1, 1, 1])), one)
    inv = op.Div(one, am1)
    u = op.Where(visible, op.Mul(am1, Z), op.Constant(value_float=float("-inf")))
    m = op.ReduceMax(u, op.Constant(value_ints=[-1]), keepdims=1)
    m = op.Where(op.IsInf(m), zero, m)
    u = op.Sub(u, m)
    lo = op.Sub(op.Mul(m, zero), one)
    hi = op.Neg(op.Pow(VisibleCount(visible), op.Neg(am1)))
    trips = op.Constant(value_int=max_iters)
    for _ in range(trips):
        mid = op.Mul(op.Add(lo, hi), op.Constant(value_float=0.5))
        s = op.ReduceSum(op.Pow(op.Relu(op.Sub(u, mid)), inv), op.Constant(value_ints=[-1]), keepdims=1)
        big = op.GreaterOrEqual(s, one)
        lo = op.Where(big, mid, lo)
        hi = op.Where(big, hi, mid)
    tau = op.Mul(op.Add(lo, hi), op.Constant(value_float=0.5))
    w = op.Where(visible, op.Pow(op.Relu(op.Sub(u, tau)), inv), zero)
    total = op.ReduceSum(w, op.Constant(value_ints=[-1]), keepdims=1)
    return op.Div(w, op.Where(op.Greater(total, zero), total, one))


# ----------------------------------------------------------------------------------- one body per norm
# Every body takes the torch op's argument list (models/op.py) in order: the tensors of docs/op.md's slots,
# then norm, causal, scale, poly as attributes (plus threshold / max_iters with defaults). Each body reads
# only what its norm needs; the exporter registers the body of the norm being exported.


@onnxscript.script(SHARP, default_opset=op)
def SharpAttention_softmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
) -> tuple[FLOAT, FLOAT]:
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    out, ent = Finish(MaskedSoftmax(z, visible), V, Q)
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttention_ssmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
) -> tuple[FLOAT, FLOAT]:
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    s = op.Reshape(ssmax_s, op.Constant(value_ints=[1, -1, 1, 1]))
    t = op.Mul(op.Mul(s, op.Log(VisibleCount(visible))), z)
    out, ent = Finish(MaskedSoftmax(t, visible), V, Q)
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttention_ssa(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
) -> tuple[FLOAT, FLOAT]:
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    zs = op.Where(visible, z, op.Constant(value_float=0.0))
    n = op.Reshape(ssa_n, op.Constant(value_ints=[1, -1, 1, 1]))
    b = op.Reshape(ssa_b, op.Constant(value_ints=[1, -1, 1, 1]))
    t = op.Mul(op.Mul(n, op.Sign(zs)), op.Log(op.Add(op.Constant(value_float=1.0), op.Mul(b, op.Abs(zs)))))
    out, ent = Finish(MaskedSoftmax(t, visible), V, Q)
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttention_adaptive(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
) -> tuple[FLOAT, FLOAT]:
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    zs = op.Where(visible, z, op.Constant(value_float=0.0))
    p0 = MaskedSoftmax(zs, visible)
    pos = op.Greater(p0, op.Constant(value_float=0.0))
    plogp = op.Where(
        pos, op.Mul(p0, op.Log(op.Where(pos, p0, op.Constant(value_float=1.0)))), op.Constant(value_float=0.0)
    )
    h = op.Neg(op.ReduceSum(plogp, op.Constant(value_ints=[-1]), keepdims=1))
    coeffs = op.Constant(value_floats=poly)
    degree = op.Sub(op.Shape(coeffs), op.Constant(value_ints=[1]))
    powers = op.Cast(op.Range(op.Squeeze(degree), op.Constant(value_int=-1), op.Constant(value_int=-1)), to=1)
    beta = op.ReduceSum(op.Mul(coeffs, op.Pow(h, powers)), op.Constant(value_ints=[-1]), keepdims=1)
    one = op.Constant(value_float=1.0)
    beta = op.Where(op.Greater(h, op.Constant(value_float=threshold)), op.Max(beta, one), one)
    out, ent = Finish(MaskedSoftmax(op.Mul(beta, zs), visible), V, Q)
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttention_entmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
) -> tuple[FLOAT, FLOAT]:
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    out, ent = Finish(EntmaxProbs(z, visible, alpha, max_iters=max_iters), V, Q)
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttention_asentmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
) -> tuple[FLOAT, FLOAT]:
    z, visible = Logits(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal)
    z = op.Mul(z, op.Unsqueeze(query_scale, [-1]))
    out, ent = Finish(EntmaxProbs(z, visible, alpha, max_iters=max_iters), V, Q)
    return out, ent


# ------------------------------------------------------------------------- streamed bodies (SPEC §3)
# Loops over key blocks of `block_size` carrying the online state; memory O(Lq · block) instead of O(Lq · Lk).


@onnxscript.script(FALLBACK, default_opset=op)
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


@onnxscript.script(FALLBACK, default_opset=op)
def BlockCount(K: FLOAT, block_size: int) -> INT64:
    size = op.Constant(value_int=block_size)
    lk = op.Squeeze(op.Shape(K, start=2, end=3))
    return op.Div(op.Sub(op.Add(lk, size), op.Constant(value_int=1)), size)


@onnxscript.script(FALLBACK, default_opset=op)
def RowState(Q: FLOAT, fill: float) -> FLOAT:
    """A (B, Hq, Lq, 1) tensor of `fill`."""
    shape = op.Concat(op.Shape(Q, start=0, end=3), op.Constant(value_ints=[1]), axis=0)
    return op.Expand(op.Constant(value_float=fill), shape)


@onnxscript.script(FALLBACK, default_opset=op)
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


@onnxscript.script(FALLBACK, default_opset=op)
def FinishState(L: FLOAT, KP: FLOAT, ACC: FLOAT) -> tuple[FLOAT, FLOAT]:
    """Output acc/Λ and entropy log Λ − K'/Λ (zeros where no key was visible)."""
    zero = op.Constant(value_float=0.0)
    live = op.Greater(L, zero)
    safe = op.Where(live, L, op.Constant(value_float=1.0))
    ent = op.Where(live, op.Sub(op.Log(safe), op.Div(KP, safe)), zero)
    return op.Div(ACC, safe), op.Squeeze(ent, op.Constant(value_ints=[-1]))


@onnxscript.script(FALLBACK, default_opset=op)
def VisibleKeys(Q: FLOAT, K: FLOAT, key_mask: BOOL, causal: int) -> FLOAT:
    """Keys each query sees over the whole row (B, 1, Lq, 1), at least 1: Σ_{j ≤ P_i} key_mask_j if causal."""
    seen = op.CumSum(op.Cast(key_mask, to=1), op.Constant(value_int=1))  # (B, Lk)
    lq = op.Squeeze(op.Shape(Q, start=2, end=3))
    lk = op.Squeeze(op.Shape(K, start=2, end=3))
    one = op.Constant(value_int=1)
    last = op.Sub(lk, one)
    qpos = op.Add(op.Range(op.Constant(value_int=0), lq, one), op.Sub(lk, lq))
    causal_pos = op.Mul(qpos, op.Constant(value_int=causal))
    pos = op.Add(causal_pos, op.Mul(op.Sub(one, op.Constant(value_int=causal)), op.Expand(last, op.Shape(qpos))))
    n = op.Gather(seen, pos, axis=1)  # (B, Lq)
    return op.Max(op.Unsqueeze(n, [1, 3]), op.Constant(value_float=1.0))


@onnxscript.script(FALLBACK, default_opset=op)
def StreamSoftmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    row_factor: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    scale: float,
    causal: int,
    ssa: int,
    block_size: int,
) -> tuple[FLOAT, FLOAT]:
    """Online softmax over t = row_factor·z (softmax, ssmax, adaptive's pass 2) or SSA's g(z) when ssa = 1."""
    lk = op.Shape(K, start=2, end=3)
    m = RowState(Q, fill=float("-inf"))
    lam = RowState(Q, fill=0.0)
    kp = RowState(Q, fill=0.0)
    acc = op.Mul(op.Expand(lam, op.Concat(op.Shape(Q, start=0, end=3), op.Shape(V, start=3), axis=0)), lam)
    use_ssa = op.Cast(op.Constant(value_int=ssa), to=9)
    n = op.Reshape(ssa_n, op.Constant(value_ints=[1, -1, 1, 1]))
    b = op.Reshape(ssa_b, op.Constant(value_ints=[1, -1, 1, 1]))
    for i in range(BlockCount(K, block_size=block_size)):
        kb, vb, mb, start = KeyBlock(K, V, key_mask, i, block_size=block_size)
        z, visible = BlockLogits(Q, kb, mb, alibi_slopes, start, lk, scale=scale, causal=causal)
        zs = op.Where(visible, z, op.Constant(value_float=0.0))
        g = op.Mul(op.Mul(n, op.Sign(zs)), op.Log(op.Add(op.Constant(value_float=1.0), op.Mul(b, op.Abs(zs)))))
        t = op.Where(use_ssa, g, op.Mul(row_factor, zs))
        m, lam, kp, r, e = OnlineStep(m, lam, kp, t, visible)
        acc = op.Add(op.Mul(r, acc), op.MatMul(e, RepeatKV(vb, Q)))
    out, ent = FinishState(lam, kp, acc)
    return out, ent


@onnxscript.script(FALLBACK, default_opset=op)
def StreamEntropy(
    Q: FLOAT, K: FLOAT, key_mask: BOOL, alibi_slopes: FLOAT, scale: float, causal: int, block_size: int
) -> FLOAT:
    """Entropy of softmax(z) per row (B, Hq, Lq, 1) in one pass without V (adaptive's pass 1)."""
    lk = op.Shape(K, start=2, end=3)
    m = RowState(Q, fill=float("-inf"))
    lam = RowState(Q, fill=0.0)
    kp = RowState(Q, fill=0.0)
    for i in range(BlockCount(K, block_size=block_size)):
        kb, _vb, mb, start = KeyBlock(K, K, key_mask, i, block_size=block_size)
        z, visible = BlockLogits(Q, kb, mb, alibi_slopes, start, lk, scale=scale, causal=causal)
        m, lam, kp, _r, _e = OnlineStep(m, lam, kp, z, visible)
    zero = op.Constant(value_float=0.0)
    live = op.Greater(lam, zero)
    safe = op.Where(live, lam, op.Constant(value_float=1.0))
    return op.Where(live, op.Sub(op.Log(safe), op.Div(kp, safe)), zero)


@onnxscript.script(FALLBACK, default_opset=op)
def StreamEntmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    lam: FLOAT,
    scale: float,
    causal: int,
    max_iters: int,
    block_size: int,
) -> tuple[FLOAT, FLOAT]:
    """Entmax over key blocks: max pass, `max_iters` bisection passes of S(τ), output pass (SPEC §3)."""
    lk = op.Shape(K, start=2, end=3)
    zero = op.Constant(value_float=0.0)
    one = op.Constant(value_float=1.0)
    neg_inf = op.Constant(value_float=float("-inf"))
    am1 = op.Sub(op.Reshape(alpha, op.Constant(value_ints=[1, -1, 1, 1])), one)
    inv = op.Div(one, am1)
    lam4 = op.Unsqueeze(lam, [-1])
    blocks = BlockCount(K, block_size=block_size)
    umax = RowState(Q, fill=float("-inf"))
    for i in range(blocks):
        kb, _vb, mb, start = KeyBlock(K, K, key_mask, i, block_size=block_size)
        z, visible = BlockLogits(Q, kb, mb, alibi_slopes, start, lk, scale=scale, causal=causal)
        u = op.Where(visible, op.Mul(am1, op.Mul(z, lam4)), neg_inf)
        umax = op.Max(umax, op.ReduceMax(u, op.Constant(value_ints=[-1]), keepdims=1))
    umax = op.Where(op.IsInf(umax), zero, umax)
    lo = op.Sub(op.Mul(umax, zero), one)
    hi = op.Neg(op.Pow(VisibleKeys(Q, K, key_mask, causal=causal), op.Neg(am1)))
    for _ in range(op.Constant(value_int=max_iters)):
        mid = op.Mul(op.Add(lo, hi), op.Constant(value_float=0.5))
        total = op.Mul(lo, zero)
        for j in range(blocks):
            kb2, _vb2, mb2, start2 = KeyBlock(K, K, key_mask, j, block_size=block_size)
            z2, visible2 = BlockLogits(Q, kb2, mb2, alibi_slopes, start2, lk, scale=scale, causal=causal)
            u2 = op.Where(visible2, op.Sub(op.Mul(am1, op.Mul(z2, lam4)), umax), neg_inf)
            total = op.Add(
                total, op.ReduceSum(op.Pow(op.Relu(op.Sub(u2, mid)), inv), op.Constant(value_ints=[-1]), keepdims=1)
            )
        big = op.GreaterOrEqual(total, one)
        lo = op.Where(big, mid, lo)
        hi = op.Where(big, hi, mid)
    tau = op.Mul(op.Add(lo, hi), op.Constant(value_float=0.5))
    zsum = op.Mul(lo, zero)
    plogp = op.Mul(lo, zero)
    acc = op.Mul(op.Expand(zsum, op.Concat(op.Shape(Q, start=0, end=3), op.Shape(V, start=3), axis=0)), zero)
    for k in range(blocks):
        kb3, vb3, mb3, start3 = KeyBlock(K, V, key_mask, k, block_size=block_size)
        z3, visible3 = BlockLogits(Q, kb3, mb3, alibi_slopes, start3, lk, scale=scale, causal=causal)
        u3 = op.Where(visible3, op.Sub(op.Mul(am1, op.Mul(z3, lam4)), umax), neg_inf)
        w = op.Where(visible3, op.Pow(op.Relu(op.Sub(u3, tau)), inv), zero)
        pos = op.Greater(w, zero)
        zsum = op.Add(zsum, op.ReduceSum(w, op.Constant(value_ints=[-1]), keepdims=1))
        wlogw = op.Where(pos, op.Mul(w, op.Log(op.Where(pos, w, one))), zero)
        plogp = op.Add(plogp, op.ReduceSum(wlogw, op.Constant(value_ints=[-1]), keepdims=1))
        acc = op.Add(acc, op.MatMul(w, RepeatKV(vb3, Q)))
    live = op.Greater(zsum, zero)
    safe = op.Where(live, zsum, one)
    ent = op.Where(live, op.Sub(op.Log(safe), op.Div(plogp, safe)), zero)
    return op.Div(acc, safe), op.Squeeze(ent, op.Constant(value_ints=[-1]))


@onnxscript.script(SHARP, default_opset=op)
def SharpAttentionStreamed_softmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
    block_size: int = 256,
) -> tuple[FLOAT, FLOAT]:
    one = op.Constant(value_float=1.0)
    out, ent = StreamSoftmax(
        Q, K, V, key_mask, alibi_slopes, one, ssa_n, ssa_b, scale=scale, causal=causal, ssa=0, block_size=block_size
    )
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttentionStreamed_ssmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
    block_size: int = 256,
) -> tuple[FLOAT, FLOAT]:
    s = op.Reshape(ssmax_s, op.Constant(value_ints=[1, -1, 1, 1]))
    factor = op.Mul(s, op.Log(VisibleKeys(Q, K, key_mask, causal=causal)))
    out, ent = StreamSoftmax(
        Q, K, V, key_mask, alibi_slopes, factor, ssa_n, ssa_b, scale=scale, causal=causal, ssa=0, block_size=block_size
    )
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttentionStreamed_ssa(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
    block_size: int = 256,
) -> tuple[FLOAT, FLOAT]:
    one = op.Constant(value_float=1.0)
    out, ent = StreamSoftmax(
        Q, K, V, key_mask, alibi_slopes, one, ssa_n, ssa_b, scale=scale, causal=causal, ssa=1, block_size=block_size
    )
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttentionStreamed_adaptive(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
    block_size: int = 256,
) -> tuple[FLOAT, FLOAT]:
    h = StreamEntropy(Q, K, key_mask, alibi_slopes, scale=scale, causal=causal, block_size=block_size)
    coeffs = op.Constant(value_floats=poly)
    degree = op.Sub(op.Shape(coeffs), op.Constant(value_ints=[1]))
    powers = op.Cast(op.Range(op.Squeeze(degree), op.Constant(value_int=-1), op.Constant(value_int=-1)), to=1)
    beta = op.ReduceSum(op.Mul(coeffs, op.Pow(h, powers)), op.Constant(value_ints=[-1]), keepdims=1)
    one = op.Constant(value_float=1.0)
    beta = op.Where(op.Greater(h, op.Constant(value_float=threshold)), op.Max(beta, one), one)
    out, ent = StreamSoftmax(
        Q, K, V, key_mask, alibi_slopes, beta, ssa_n, ssa_b, scale=scale, causal=causal, ssa=0, block_size=block_size
    )
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttentionStreamed_entmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
    block_size: int = 256,
) -> tuple[FLOAT, FLOAT]:
    ones = op.Squeeze(RowState(Q, fill=1.0), op.Constant(value_ints=[-1]))
    out, ent = StreamEntmax(
        Q,
        K,
        V,
        key_mask,
        alibi_slopes,
        alpha,
        ones,
        scale=scale,
        causal=causal,
        max_iters=max_iters,
        block_size=block_size,
    )
    return out, ent


@onnxscript.script(SHARP, default_opset=op)
def SharpAttentionStreamed_asentmax(
    Q: FLOAT,
    K: FLOAT,
    V: FLOAT,
    key_mask: BOOL,
    alibi_slopes: FLOAT,
    alpha: FLOAT,
    query_scale: FLOAT,
    ssa_n: FLOAT,
    ssa_b: FLOAT,
    ssmax_s: FLOAT,
    norm: str,
    causal: int,
    scale: float,
    poly: list[float],
    threshold: float = 0.5,
    max_iters: int = 40,
    block_size: int = 256,
) -> tuple[FLOAT, FLOAT]:
    out, ent = StreamEntmax(
        Q,
        K,
        V,
        key_mask,
        alibi_slopes,
        alpha,
        query_scale,
        scale=scale,
        causal=causal,
        max_iters=max_iters,
        block_size=block_size,
    )
    return out, ent


STREAMED_BODIES = {
    "softmax": SharpAttentionStreamed_softmax,
    "ssmax": SharpAttentionStreamed_ssmax,
    "ssa": SharpAttentionStreamed_ssa,
    "adaptive": SharpAttentionStreamed_adaptive,
    "entmax": SharpAttentionStreamed_entmax,
    "asentmax": SharpAttentionStreamed_asentmax,
}
STREAMED_HELPERS = (
    KeyBlock,
    BlockCount,
    RowState,
    OnlineStep,
    FinishState,
    VisibleKeys,
    StreamSoftmax,
    StreamEntropy,
    StreamEntmax,
)

BODIES = {
    "softmax": SharpAttention_softmax,
    "ssmax": SharpAttention_ssmax,
    "ssa": SharpAttention_ssa,
    "adaptive": SharpAttention_adaptive,
    "entmax": SharpAttention_entmax,
    "asentmax": SharpAttention_asentmax,
}
HELPERS = (RepeatKV, BlockLogits, Logits, MaskedSoftmax, Finish, VisibleCount, EntmaxProbs)
