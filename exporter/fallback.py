"""Standard-op bodies of `sharp::SharpAttention` (dense: the logits are materialised), one per norm.

Stock ONNX Runtime runs a file through these model-local functions; a registered kernel for
(sharp, SharpAttention) replaces them. ONNX functions cannot branch on a string attribute, so each norm has
its own body, stored as an *overload* of the one op (docs/op.md). Shared steps are helper functions in the
private domain `sharp.fallback`. Everything is computed in float32, in the order of docs/attention.md.
"""

from collections.abc import Sequence

import onnxscript
from onnx.defs import OpSchema
from onnxscript import BOOL, FLOAT
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
def Logits(Q: FLOAT, K: FLOAT, key_mask: BOOL, alibi_slopes: FLOAT, scale: float, causal: int) -> tuple[FLOAT, BOOL]:
    """z = scale·q·kᵀ + slope·(j − P_i) and the visibility mask (causal, key_mask); Lq ≤ Lk, P_i = Lk − Lq + i."""
    k_rep = RepeatKV(K, Q)
    z = op.Mul(op.MatMul(Q, op.Transpose(k_rep, perm=[0, 1, 3, 2])), op.Constant(value_float=scale))
    lq = op.Shape(Q, start=2, end=3)
    lk = op.Shape(K, start=2, end=3)
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    qpos = op.Add(op.Range(op.Squeeze(zero), op.Squeeze(lq), op.Squeeze(one)), op.Squeeze(op.Sub(lk, lq)))
    kpos = op.Range(op.Squeeze(zero), op.Squeeze(lk), op.Squeeze(one))
    rel = op.Sub(op.Unsqueeze(kpos, [0]), op.Unsqueeze(qpos, [1]))  # (Lq, Lk) = j − P_i
    slopes = op.Reshape(alibi_slopes, op.Constant(value_ints=[1, -1, 1, 1]))
    z = op.Add(z, op.Mul(slopes, op.Cast(rel, to=1)))
    not_causal = op.Not(op.Cast(op.Constant(value_int=causal), to=9))
    visible = op.And(op.Or(not_causal, op.LessOrEqual(rel, op.Squeeze(zero))), op.Unsqueeze(key_mask, [1, 2]))
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


BODIES = {
    "softmax": SharpAttention_softmax,
    "ssmax": SharpAttention_ssmax,
    "ssa": SharpAttention_ssa,
    "adaptive": SharpAttention_adaptive,
    "entmax": SharpAttention_entmax,
    "asentmax": SharpAttention_asentmax,
}
HELPERS = (RepeatKV, Logits, MaskedSoftmax, Finish, VisibleCount, EntmaxProbs)
