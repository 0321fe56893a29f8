"""Shared pieces of the fallback bodies, as functions of the private `sharp.fallback` domain.

Each formula is written once here and used by the dense and the streamed bodies: the logits of a key block,
the masked softmax, SSA's g(z), adaptive's β(H), Σ w log w and the entropy finish, and entmax's threshold
sums and safeguarded Halley/Newton step. Everything is float32, in the order of docs/attention.md.
"""

from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset18 as op

from sharp.exporter.op_schema import FALLBACK


@script(FALLBACK, default_opset=op)
def RepeatKV(X: FLOAT, Q: FLOAT) -> FLOAT:
    """GQA: (B, Hkv, L, D) → (B, Hq, L, D), query head h reading KV head h // (Hq / Hkv)."""
    b = op.Shape(X, start=0, end=1)
    hkv = op.Shape(X, start=1, end=2)
    rest = op.Shape(X, start=2)
    hq = op.Shape(Q, start=1, end=2)
    group = op.Div(hq, hkv)
    expanded = op.Expand(op.Unsqueeze(X, [2]), op.Concat(b, hkv, group, rest, axis=0))
    return op.Reshape(expanded, op.Concat(b, hq, rest, axis=0))


@script(FALLBACK, default_opset=op)
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


@script(FALLBACK, default_opset=op)
def MaskedSoftmax(T: FLOAT, visible: BOOL) -> FLOAT:
    """softmax over the last axis with masked entries exactly 0 and rows with nothing visible all 0."""
    neg_inf = op.Constant(value_float=float("-inf"))
    t = op.Where(visible, T, neg_inf)
    m = op.ReduceMax(t, op.Constant(value_ints=[-1]), keepdims=1)
    m = op.Where(op.IsInf(m), op.Constant(value_float=0.0), m)
    e = op.Where(visible, op.Exp(op.Sub(t, m)), op.Constant(value_float=0.0))
    s = op.ReduceSum(e, op.Constant(value_ints=[-1]), keepdims=1)
    return op.Div(e, op.Where(op.Greater(s, op.Constant(value_float=0.0)), s, op.Constant(value_float=1.0)))


@script(FALLBACK, default_opset=op)
def SignedLog(Z: FLOAT, visible: BOOL, ssa_n: FLOAT, ssa_b: FLOAT) -> FLOAT:
    """SSA's g(z) = sgn(z) · n · log1p(b |z|) per head; evaluated on 0 where the key is hidden."""
    zs = op.Where(visible, Z, op.Constant(value_float=0.0))
    n = op.Reshape(ssa_n, op.Constant(value_ints=[1, -1, 1, 1]))
    b = op.Reshape(ssa_b, op.Constant(value_ints=[1, -1, 1, 1]))
    return op.Mul(op.Mul(n, op.Sign(zs)), op.Log(op.Add(op.Constant(value_float=1.0), op.Mul(b, op.Abs(zs)))))


@script(FALLBACK, default_opset=op)
def AdaptiveBeta(H: FLOAT, poly: list[float], threshold: float) -> FLOAT:
    """β = max(poly(H), 1) where H > threshold, else 1 (poly highest power first)."""
    coeffs = op.Constant(value_floats=poly)
    degree = op.Sub(op.Shape(coeffs), op.Constant(value_ints=[1]))
    powers = op.Cast(op.Range(op.Squeeze(degree), op.Constant(value_int=-1), op.Constant(value_int=-1)), to=1)
    beta = op.ReduceSum(op.Mul(coeffs, op.Pow(H, powers)), op.Constant(value_ints=[-1]), keepdims=1)
    one = op.Constant(value_float=1.0)
    return op.Where(op.Greater(H, op.Constant(value_float=threshold)), op.Max(beta, one), one)


@script(FALLBACK, default_opset=op)
def PLogP(W: FLOAT) -> FLOAT:
    """Σ_{w>0} w log w over the last axis (kept)."""
    pos = op.Greater(W, op.Constant(value_float=0.0))
    terms = op.Where(
        pos, op.Mul(W, op.Log(op.Where(pos, W, op.Constant(value_float=1.0)))), op.Constant(value_float=0.0)
    )
    return op.ReduceSum(terms, op.Constant(value_ints=[-1]), keepdims=1)


@script(FALLBACK, default_opset=op)
def EntropyFinish(Z: FLOAT, WLOGW: FLOAT) -> FLOAT:
    """Entropy of w / Z from Z = Σ w and Σ w log w: log Z − Σ w log w / Z (0 where Z = 0), last axis dropped."""
    zero = op.Constant(value_float=0.0)
    live = op.Greater(Z, zero)
    safe = op.Where(live, Z, op.Constant(value_float=1.0))
    ent = op.Where(live, op.Sub(op.Log(safe), op.Div(WLOGW, safe)), zero)
    return op.Squeeze(ent, op.Constant(value_ints=[-1]))


@script(FALLBACK, default_opset=op)
def VisibleCount(visible: BOOL) -> FLOAT:
    """Visible keys per row (B, H|1, Lq, 1), at least 1, from a dense visibility mask."""
    n = op.ReduceSum(op.Cast(visible, to=1), op.Constant(value_ints=[-1]), keepdims=1)
    return op.Max(n, op.Constant(value_float=1.0))


@script(FALLBACK, default_opset=op)
def VisibleKeys(Q: FLOAT, K: FLOAT, key_mask: BOOL, causal: int) -> FLOAT:
    """Visible keys per row (B, 1, Lq, 1), at least 1, from the key mask alone: Σ_{j ≤ P_i} key_mask_j if causal."""
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


@script(FALLBACK, default_opset=op)
def EntmaxShifted(Z: FLOAT, visible: BOOL, am1: FLOAT, lam: FLOAT) -> FLOAT:
    """u = (α − 1) λ z with hidden keys at −inf (shifting by the row max is the caller's)."""
    lam4 = op.Unsqueeze(lam, [-1])
    return op.Where(visible, op.Mul(am1, op.Mul(Z, lam4)), op.Constant(value_float=float("-inf")))


@script(FALLBACK, default_opset=op)
def ThresholdSums(U: FLOAT, tau: FLOAT, inv: FLOAT) -> tuple[FLOAT, FLOAT, FLOAT]:
    """With d = [u − τ]_+: Σ d^inv, Σ d^(inv−1), Σ_{d>0} d^(inv−2) (inv = 1/(α−1)), last axis kept — one power
    per element (d^(inv−1)), the other two sums by one multiplication and one division."""
    zero = op.Constant(value_float=0.0)
    one = op.Constant(value_float=1.0)
    d = op.Relu(op.Sub(U, tau))
    live = op.Greater(d, zero)
    dl = op.Where(live, d, one)
    p1 = op.Where(live, op.Pow(dl, op.Sub(inv, one)), zero)
    axis = op.Constant(value_ints=[-1])
    s0 = op.ReduceSum(op.Mul(p1, d), axis, keepdims=1)
    s1 = op.ReduceSum(p1, axis, keepdims=1)
    s2 = op.ReduceSum(op.Div(p1, dl), axis, keepdims=1)
    return s0, s1, s2


@script(FALLBACK, default_opset=op)
def ThresholdStep(
    tau: FLOAT, lo: FLOAT, hi: FLOAT, s0: FLOAT, s1: FLOAT, s2: FLOAT, inv: FLOAT
) -> tuple[FLOAT, FLOAT, FLOAT, BOOL]:
    """One safeguarded root step for S(τ) = 1 (docs/attention.md): the bracket from the sign of S − 1, Halley's
    step where inv ≥ 2 (S'' bounded), Newton's otherwise, bisection when the step leaves the bracket.
    Returns (τ, lo, hi, every row converged to 4 ulp)."""
    one = op.Constant(value_float=1.0)
    zero = op.Constant(value_float=0.0)
    f = op.Sub(s0, one)
    above = op.Greater(f, zero)
    lo = op.Where(above, tau, lo)
    hi = op.Where(above, hi, tau)
    fp = op.Neg(op.Mul(inv, s1))
    fpp = op.Mul(op.Mul(inv, op.Sub(inv, one)), s2)
    two = op.Constant(value_float=2.0)
    halley = op.Div(op.Mul(op.Mul(two, f), fp), op.Sub(op.Mul(op.Mul(two, fp), fp), op.Mul(f, fpp)))
    newton = op.Div(f, fp)
    cand = op.Sub(tau, op.Where(op.GreaterOrEqual(inv, two), halley, newton))
    finite = op.Not(op.Or(op.IsNaN(cand), op.IsInf(cand)))
    ok = op.And(finite, op.And(op.GreaterOrEqual(cand, lo), op.LessOrEqual(cand, hi)))
    new = op.Where(ok, cand, op.Mul(op.Add(lo, hi), op.Constant(value_float=0.5)))
    tol = op.Constant(value_float=4.76837158203125e-07)  # 4 ulp of 1.0 in float32
    small = op.Or(op.LessOrEqual(op.Abs(op.Sub(new, tau)), tol), op.LessOrEqual(op.Sub(hi, lo), tol))
    done = op.Or(small, op.Equal(f, zero))
    all_done = op.Cast(op.ReduceMin(op.Cast(done, to=1), keepdims=0), to=9)
    return new, lo, hi, all_done


@script(FALLBACK, default_opset=op)
def ThresholdStart(n: FLOAT, am1: FLOAT) -> tuple[FLOAT, FLOAT]:
    """The bracket of τ relative to the row max: [−1, −n^{1−α}] for n visible keys."""
    hi = op.Neg(op.Pow(n, op.Neg(am1)))
    lo = op.Sub(op.Mul(hi, op.Constant(value_float=0.0)), op.Constant(value_float=1.0))
    return lo, hi


PARTS = (
    RepeatKV,
    BlockLogits,
    MaskedSoftmax,
    SignedLog,
    AdaptiveBeta,
    PLogP,
    EntropyFinish,
    VisibleCount,
    VisibleKeys,
    EntmaxShifted,
    ThresholdSums,
    ThresholdStep,
    ThresholdStart,
)
