"""The entmax threshold search: the powers of the support, the safeguarded Halley / Newton step, the per-class
model whose root a pass steps to, the bracket and the seed (docs/kernels.md)."""

from __future__ import annotations

import triton
import triton.language as tl

from sharp.plugins.triton.common import (
    LN2,
    _fold_max,
    _fold_sum,
    _log2,
)

# A Halley step on S − 1 this small leaves an error of the order of its cube: the threshold search takes it as
# converged without a pass to confirm it (`_refine`).
SETTLED_STEP = tl.constexpr(1.0e-3)
# Newton steps of the threshold search's seed (`_seed`) on the row's PARTIALS column-class maxima: from τ = −1 the
# step on S^(1/inv) lands on the small problem's root in two or three (a fourth moved no pass count measured).
SEED_STEPS = tl.constexpr(4)
# Newton steps of the class model (`_class_model_root`) per threshold pass: from the pass's τ, where the model's S is
# the row's, the model's root is reached to fp32 in three or four (six moved no pass count in a NumPy model of the
# search).
MODEL_STEPS = tl.constexpr(4)
# Bisection steps of the class model for α > 2 (`_class_bisection_root`): the bracket's width (≤ 1) to 2^-28, below
# fp32's resolution of τ.
BISECT_STEPS = tl.constexpr(28)
# Bisection steps of the split of a class's two hidden keys (`_two_keys`): to 2^-21 of their shares of S, whose model
# step a pass confirms.
TWO_KEY_STEPS = tl.constexpr(20)
# Where an entmax weight is 0 its log2 is taken at this floor instead (finite, so 0·log2 is 0, with no select).
LOG_FLOOR = tl.constexpr(1.0e-30)
LOG2_FLOOR = tl.constexpr(-99.66)  # log2 of LOG_FLOOR: the same floor applied to a log2 already taken
# The general-α threshold sweep whose power b = d^e has e ≤ 0 (`_power_exponent`: a head with α = 1.5 among per-head
# α, α ≥ 2, or rows of several heads): b is not 0 where d = 0, so it is formed at the log floor and selected; at α > 2
# its third sum counts the keys in the support (a select where Σ d^(inv+1) took a multiply: the class model reads from
# it whether it models the hidden keys exactly). The FAST value of that sweep (the TensorRT form walks every head's
# keys in it); the kernels' FAST = 0 sweep needs e > 0.
GENERAL_SELECTED = tl.constexpr(3)


@triton.jit
def _support(x, tau):
    """d = [x − τ]_+ for x = u − max u ≤ 0 and τ ≥ −1 (the bracket's low end), so d ≤ 1: written as a clamp to
    [0, 1], which ptxas folds into the subtraction (FADD.SAT) — one instruction where max(·, 0) took two. (x may
    pass 0 by an ulp where the row max was rounded apart; d then saturates an ulp early.)"""
    return tl.minimum(tl.maximum(x - tau, 0.0), 1.0)


@triton.jit
def _power_exponent(inv):
    """e of the general path's one power b = d^e: inv − 2 where _refine takes Halley's step and reads S'' (inv ≥ 2),
    inv − 1 where it takes Newton's (whose far steps read the third sum, b·d² = d^(inv+1))."""
    return tl.where(inv >= 2.0, inv - 2.0, inv - 1.0)


@triton.jit
def _powers(d, inv, FAST: tl.constexpr):
    """Per-element terms of the threshold sums for d ≥ 0, each 0 where d = 0. FAST = 2: inv = 2 (α = 1.5); FAST =
    1: inv = 1 (α = 2) — (d^inv, d^(inv−1), d^(inv−2)), no exp/log; otherwise one log2 and one exp2 on the MUFU,
    b = d^e (`_power_exponent`) and its products b·d², b·d, which _power_sums turns into those sums."""
    if FAST == 2:
        p0 = d * d
        p1 = d
        p2 = tl.where(d > 0, 1.0, 0.0)
    elif FAST == 1:  # α = 2 takes Newton's step: S'' is not needed
        p0 = d
        p1 = tl.where(d > 0, 1.0, 0.0)
        p2 = tl.zeros_like(d)
    elif FAST == GENERAL_SELECTED:  # e ≤ 0 possible: at d = 0 the floor keeps b finite
        # (b ≤ 1 where e ≥ 0; e > −1, so 2^(99.7·|e|) fits fp32), so the products are 0 without a select; b itself is
        # selected
        b = tl.math.exp2(_power_exponent(inv) * _log2(tl.maximum(d, LOG_FLOOR)))
        p1 = b * d
        # at α > 2 (inv < 1) the count of keys in the support, not Σ d^(inv+1) (`_class_root`)
        p0 = tl.where(inv < 1.0, tl.where(d > 0, 1.0, 0.0), p1 * d)
        p2 = tl.where(d > 0, b, 0.0)
    else:  # e > 0 (the program checked): log2 0 = −inf, so b = 2^(e·log2 d) is 0 exactly where d = 0 — no floor, no
        # select
        b = tl.math.exp2(_power_exponent(inv) * _log2(d))
        p1 = b * d
        p0 = p1 * d
        p2 = b
    return p0, p1, p2


@triton.jit
def _power_sums(s0, s1, s2, inv, FAST: tl.constexpr):
    """(Σ d^inv, Σ d^(inv−1), and Σ d^(inv−2) where _refine takes Halley's step, Σ d^(inv+1) where it takes
    Newton's) from the sums of _powers. The general path sums b·d², b·d and b for b = d^e with e = inv − 2 where
    _refine reads S'' (Halley, inv ≥ 2) and e = inv − 1 below (Newton, whose far steps read b·d² = d^(inv+1)) —
    one exp2 per element instead of two. (α = 2's path sums no d^(inv+1): 0 in its place.)"""
    if FAST == 0 or FAST == GENERAL_SELECTED:
        halley = inv >= 2.0
        s0, s1, s2 = tl.where(halley, s0, s1), tl.where(halley, s1, s2), tl.where(halley, s2, s0)
    return s0, s1, s2


@triton.jit
def _general_weight(d, inv):
    """w = d^inv for a general α and log2 d floored (w·log2 d is then 0 where d = 0): log2 0 = −inf, so exp2 gives
    the weight 0 exactly (inv > 0), with no select."""
    lg = _log2(d)
    return tl.math.exp2(inv * lg), tl.maximum(lg, LOG2_FLOOR)


@triton.jit
def _output_weights(d, inv, FAST: tl.constexpr, ENTROPY: tl.constexpr):
    """w = d^inv and, with ENTROPY, log2 d floored where d = 0 (whose w is 0, so w·log2 d is 0 there); log2 on the
    MUFU."""
    if FAST == 0 or FAST == GENERAL_SELECTED:
        w, lg = _general_weight(d, inv)
    else:
        w = d * d if FAST == 2 else d
        lg = _log2(tl.maximum(d, LOG_FLOOR)) if ENTROPY else d
    return w, lg


@triton.jit
def _weights(d, inv, FAST: tl.constexpr):
    """w and log w (0·finite where d = 0) for the decode output kernels, which always form the entropy."""
    w, lg = _output_weights(d, inv, FAST, True)
    return w, (inv * LN2) * lg


@triton.jit
def _tile_z(w, E0, MMA_SUMS: tl.constexpr):
    """A tile's Σ w per row: MMA_SUMS, as (rows, 8) column partials formed by the tensor cores from w as P·V sees it
    (rounded to E0's type)."""
    if MMA_SUMS:
        z = tl.dot(w.to(E0.dtype), E0)
    else:
        z = tl.sum(w, 1)
    return z


@triton.jit
def _refine(tau, lo, hi, s0, s1, s2, inv, tol, ptau, pfp, model, model_c2, gap, exact, MODELED: tl.constexpr):
    """One safeguarded root step for S(τ) = Σ d^inv = 1 per row: the streamed oracle's `refine_threshold` (Halley
    where S'' is bounded, α ≤ 1.5, Newton otherwise, bisection when the step leaves the bracket) with five
    additions that save passes — steps on S^(1/inv) while S > 1.25 (on a power law fitted to S, S' and T =
    Σ d^(inv+1) where S'' is not summed), S'' from the previous pass's S' where it is not summed, a settling
    rule (below) and, MODELED, Newton's rows (1 ≤ inv < 2), α > 2 (inv < 1) and, where it is `exact`, Halley's rows
    step to the root of their class model (`model`, whose hidden keys' S'' at τ is model_c2: `_class_root`) where
    it lies in the bracket. s2: Σ d^(inv−2) on Halley's rows, T on
    Newton's. (ptau, pfp): the previous pass's τ and S' (on the first, fp = 0 at τ). gap: the distance from τ to the
    row's nearest key where it was kept (α = 2; else 0). Returns τ, the bracket, convergence and this pass's
    (τ, S')."""
    f = s0 - 1.0
    above = f > 0
    lo = tl.where(above, tau, lo)
    hi = tl.where(above, hi, tau)
    fp = -inv * s1
    fpp = inv * (inv - 1.0) * s2
    halley = 2.0 * f * fp / (2.0 * fp * fp - f * fpp)
    newton = f / fp
    step = tl.where(inv >= 2.0, halley, newton)
    # Far from the root (S > 1.25) the steps are taken on h = S^(1/inv) − 1 instead — a norm of the [u − τ]_+, so
    # convex and near-linear in τ (exactly linear while the support holds equal values): Halley's (Newton's for
    # inv < 2) step on it lands in one or two passes where S's own creeps (S ≫ 1 at the bracket's low end). Near
    # the root the exact f = S − 1 steps again, so convergence to a few ulp is unchanged.
    r = tl.exp2(tl.log2(tl.maximum(s0, 1.0)) / inv)  # S^(1/inv) ≥ 1
    hq = (r - 1.0) * s0  # h / (−h') · s1 = (r − 1)·S / r, times r
    h_halley = -2.0 * hq * s1 / (2.0 * r * s1 * s1 - (r - 1.0) * (inv - 1.0) * (s0 * s2 - s1 * s1))
    # Newton's step on h is the root of the power law S = A·(c − τ)^inv through S and S'. Where S'' is not summed,
    # the exponent is fitted instead: for S = A·(c − τ)^p, T = Σ d^(inv+1) = (inv+1)·∫S is A·(c − τ)^(p+1)·(inv+1)
    # / (p+1), so T·S'/S² = −(inv+1)·p/(p+1) gives p from this pass's sums (held to [inv, 4·inv]; inv where T is not
    # summed). Keys entering the support as τ falls make p exceed inv, so the fitted step lands closer (α = 1.75:
    # 5.6 → 4.4 passes per program).
    q = -s2 * fp / ((inv + 1.0) * s0 * s0)
    p = q / (1.0 - q)
    p = tl.where((p > 0.0) & (p < float("inf")), tl.minimum(tl.maximum(p, inv), 4.0 * inv), inv)
    h_power = (p * (s0 / fp)) * (1.0 - tl.exp2(-tl.log2(tl.maximum(s0, 1.0)) / p))
    step = tl.where(s0 > 1.25, tl.where(inv >= 2.0, h_halley, h_power), step)
    # Newton's rows with 1 < inv < 2 (S convex, S'' unbounded where a key enters, so not summed): near the root S''
    # is taken from the change in S' since the previous pass (a secant), for a Halley step — and for the settling
    # rule, whose error estimate is that curvature's: |S''/2S'|·step².
    curv = (fp - pfp) / (tau - ptau)
    sec = 2.0 * f * fp / (2.0 * fp * fp - f * curv)
    newton_rows = (tl.zeros_like(tau) + inv > 1.0) & (tl.zeros_like(tau) + inv < 2.0)
    secant = newton_rows & (s0 <= 1.25) & (curv >= 0.0) & (curv < float("inf")) & (tl.abs(sec) < float("inf"))
    step = tl.where(secant, sec, step)
    cand = tau - step
    if MODELED:  # rows whose class model has a root in the bracket step there (Halley's: where it is exact)
        modeled = ((tl.zeros_like(tau) + inv < 2.0) | exact) & (model == model) & (model >= lo) & (model <= hi)
        cand = tl.where(modeled, model, cand)
    else:
        modeled = tau != tau
    ok = (cand == cand) & (tl.abs(cand) < float("inf")) & (cand >= lo) & (cand <= hi)
    # α > 2 (inv < 1): Newton can cycle between the bracket's ends; a step across over half of it bisects instead
    ok = ok & ((tl.zeros_like(tau) + inv >= 1.0) | (tl.abs(cand - tau) <= 0.5 * (hi - lo)) | (modeled & exact))
    new = tl.where(ok, cand, 0.5 * (lo + hi))
    # A Halley step near the root (the exact f = S − 1 one, taken inside the bracket) leaves an error of the order of
    # the step cubed: a step below tol^(1/3) / 8 needs no pass to confirm it.
    settled = ok & (s0 <= 1.25) & (tl.zeros_like(tau) + inv >= 2.0) & (tl.abs(new - tau) <= SETTLED_STEP)
    settled = settled | (
        ok & secant & ~modeled & (tl.abs(step) <= SETTLED_STEP) & (tl.abs(curv / fp) * step * step <= tol / 4)
    )
    # At α = 2 S is piecewise linear, and the step — Newton's, or to the class model's root, whose known keys are
    # exact and whose hidden share is linear with the hidden keys' count as its slope — lands on the root exactly
    # unless a key lies within the step of τ: a step shorter than the distance to the nearest key needs no pass to
    # confirm it.
    settled = settled | (ok & (tl.abs(new - tau) < gap)) | (ok & modeled & exact)
    if MODELED:
        # A model step's error is that of the curvature it missed: the model matches S and S' at τ, so the error
        # is about |S'' − the model's S''|·step² / 2|S'| ≤ (|S''| + |the model's S''|)·step² / 2|S'|, S'' taken from
        # the secant as above (at α > 2, where S is concave between keys, of either sign); the rule holds twice that
        # to a quarter of the tolerance.
        taken = new - tau
        low_k = tl.zeros_like(tau) + inv < 1.0
        near = (newton_rows & (curv >= 0.0) | low_k) & (s0 <= 1.25) & (tl.abs(curv) < float("inf"))
        bound = (tl.abs(curv) + tl.abs(model_c2)) / tl.abs(fp) * taken * taken
        settled = settled | (ok & modeled & near & (tl.abs(taken) <= SETTLED_STEP) & (bound <= tol / 4))
    conv = (tl.abs(new - tau) <= tol) | (f == 0) | ((hi - lo) <= tol) | settled
    return new, lo, hi, conv, tau, fp


@triton.jit
def _add_powers(s0, s1, s2, d, gap, inv, FAST: tl.constexpr, MMA_SUMS: tl.constexpr):
    """The threshold sums of one tile, added per row (MMA_SUMS: folded into (rows, 16) column partials — d² by
    FFMA at α = 1.5). At α = 2 (FAST = 1), whose S'' is 0, s2 keeps instead the row's max of gap = −|x − τ|: minus
    the distance from τ to the nearest key (`_refine`'s exact steps)."""
    p0, p1, p2 = _powers(d, inv, FAST)
    if FAST == 1:
        s2 = _fold_max(s2, gap) if MMA_SUMS else tl.maximum(s2, tl.max(gap, 1))
        s0, s1 = (_fold_sum(s0, p0), _fold_sum(s1, p1)) if MMA_SUMS else (s0 + tl.sum(p0, 1), s1 + tl.sum(p1, 1))
    elif not MMA_SUMS:
        s0, s1, s2 = s0 + tl.sum(p0, 1), s1 + tl.sum(p1, 1), s2 + tl.sum(p2, 1)
    elif FAST == 2:
        s0, s1, s2 = _fold_sum(s0, p0), _fold_sum(s1, d), _fold_sum(s2, p2)
    else:
        s0, s1, s2 = _fold_sum(s0, p0), _fold_sum(s1, p1), _fold_sum(s2, p2)
    return s0, s1, s2


@triton.jit
def _class_model(xc, tau, c0, c1, k):
    """The class model of S = Σ d^k at τ (k one per row) from one threshold pass's sums kept per key class (c0 = Σ d^k,
    c1 = Σ d^(k−1); class j ≡ c (mod classes), as the max sweep's maxima xc): in each class its max, a key of the
    row, is exact and the keys it hides are one key a·(c − τ)_+^k, fitted to their share of the class's two sums —
    exact where a class hides one key in the support, or several at one value. (A class that hides none may keep
    shares of a rounding's size: their key's S stays of that size for every τ above this one.) Returns (a, c) per
    class and the hidden keys' S'' at τ per row."""
    kk = k[:, None]
    d = tl.maximum(xc - tau[:, None], 0.0)
    lg = _log2(d)  # −inf where d = 0: d^k = 0 there; d^(k−1) is selected
    r = tl.maximum(c0 - tl.math.exp2(kk * lg), 0.0)
    r1 = tl.maximum(c1 - tl.where(d > 0, tl.math.exp2((kk - 1.0) * lg), 0.0), 0.0)
    y = r / r1  # c − τ: S / −S' = (c − τ) / k for one key
    hidden = (r > 0.0) & (r1 > 0.0) & (y < float("inf"))
    ly = _log2(tl.where(hidden, y, 1.0))
    a = tl.where(hidden, r * tl.math.exp2(-kk * ly), 0.0)
    c = tau[:, None] + tl.where(hidden, y, 0.0)
    return a, c, tl.sum(a * kk * (kk - 1.0) * tl.math.exp2((kk - 2.0) * ly), 1), r, r1


@triton.jit
def _two_keys(r, r1, k):
    """The two keys d1 ≥ d2 of a class that hides two in the support, from their shares r = Σ d^k and r1 = Σ d^(k−1)
    (k < 1): with d_i^k = t·r and (1 − t)·r, t in [1/2, 1), r^e·(t^e + (1 − t)^e) = r1 (e = (k − 1)/k < 0: rising
    in t there), bisected per class."""
    kk = k[:, None]
    e = (kk - 1.0) / kk
    re = tl.math.exp2(e * _log2(r))
    lo = r * 0.0 + 0.5
    hi = lo + 0.5
    for _ in tl.static_range(TWO_KEY_STEPS):
        t = 0.5 * (lo + hi)
        low = re * (tl.math.exp2(e * _log2(t)) + tl.math.exp2(e * _log2(1.0 - t))) < r1
        lo, hi = tl.where(low, t, lo), tl.where(low, hi, t)
    t = 0.5 * (lo + hi)
    return tl.math.exp2(_log2(t * r) / kk), tl.math.exp2(_log2((1.0 - t) * r) / kk)


@triton.jit
def _key_sums(c, a, t, k):
    """Σ a·(c − t)_+^k and Σ a·(c − t)_+^(k−1) per row over keys at c of weight a (rows, n)."""
    kk = k[:, None]
    h = tl.maximum(c - t[:, None], 0.0)
    lh = _log2(h)  # −inf where 0: the power h^k is 0 there, h^(k−1) selected
    return tl.sum(a * tl.math.exp2(kk * lh), 1), tl.sum(tl.where(h > 0, a * tl.math.exp2((kk - 1.0) * lh), 0.0), 1)


@triton.jit
def _class_sums(xc, a, c, t, k):
    """The class model's S and Σ d^(k−1) at τ = t (see `_class_model`)."""
    s, s1 = _key_sums(xc, 1.0, t, k)
    h, h1 = _key_sums(c, a, t, k)
    return s + h, s1 + h1


@triton.jit
def _class_model_root(xc, a, c, tau, k):
    """Where Newton's rows (1 ≤ k < 2) step: the class model's root (`_class_model`), found per row by Newton's
    steps from τ, where the model's S and slope are the row's — no work per key. S is convex, so from a τ below the
    root the steps rise to it without overshooting. Returns the root (NaN or out of the bracket where the model has
    none) and the last step's length (the root's error once it is below fp32's)."""
    t = tau
    step = tau * 0.0
    for _ in tl.static_range(MODEL_STEPS):
        s, s1 = _class_sums(xc, a, c, t, k)
        step = (s - 1.0) / (k * s1)
        t = t + step
    return t, tl.abs(step)


@triton.jit
def _class_bisection_root(xc, a, c, a2, c2, lo, hi, f_lo, k):
    """The class model's root at α > 2 (k < 1, S concave between keys: Newton's steps on it overshoot and cycle),
    with a second hidden key of weight a2 at c2 per class, found per row by bisection on the bracket [lo, hi], where
    S − 1 at lo is f_lo: the end where the model's S is nearer 1."""
    f_hi = tl.zeros_like(f_lo) - float("inf")
    for _ in tl.static_range(BISECT_STEPS):
        m = 0.5 * (lo + hi)
        s, _ = _class_sums(xc, a, c, m, k)
        s2, _ = _key_sums(c2, a2, m, k)
        f = s + s2 - 1.0
        above = f > 0.0
        lo, hi = tl.where(above, m, lo), tl.where(above, hi, m)
        f_lo, f_hi = tl.where(above, f, f_lo), tl.where(above, f_hi, f)
    # 28 halvings leave the ends an ulp or two of τ apart: the root is the end where the model's S is nearer 1
    return tl.where(tl.abs(f_lo) < tl.abs(f_hi), lo, hi)


@triton.jit
def _class_partials(s0, s1, s2, k, FAST: tl.constexpr):
    """A threshold pass's sums of _powers kept per key class (rows, classes) as the class model reads them: Σ d^k,
    Σ d^(k−1) and, where the pass counted the keys in the support (`counted`, per row), that count: α = 1.5's Σ d^0
    (its third sum), α = 2's (its second), the selecting sweep's third sum at α > 2."""
    if FAST == 2:
        return s0, s1, s2, k == k
    elif FAST == 1:
        return s0, s1, s1, k == k
    else:  # Newton's rows (the model's): Σ b·d, Σ b (Σ d^0 where k = 1), and Σ b·d² — a count where k < 1
        return s1, s2, tl.where(k[:, None] < 1.0, s0, s2), k <= 1.0


@triton.jit
def _class_root(xc, tau, lo, hi, c0, c1, counts, counted, s0, k, tol, dead):
    """Where the class model (`_class_model`, from a pass's `_class_partials` at τ, whose S summed over the row is s0)
    puts the root, per row: Newton's steps on it (`_class_model_root`), bisection where k < 1 on [lo, hi] as the pass
    leaves it. Where the pass counted the support, a model whose every class hides at most one key in it is the
    row's S for every τ above this one, so its root, where S ≥ 1 here, is the row's: `exact`, and needs no pass to
    confirm it. Returns the root, the hidden keys' S'' at τ and that flag."""
    hides = counts - tl.where(xc > tau[:, None], 1.0, 0.0)  # the keys each class hides in the support
    a, c, model_c2, r, r1 = _class_model(xc, tau, c0, c1, k)
    one = counted & (tl.max(hides, 1) <= 1.5) & (s0 >= 1.0)
    model, last = _class_model_root(xc, a, c, tau, k)
    exact = one & (last <= tol)
    if tl.min(tl.where(dead, 1.0, k), 0) < 1.0:  # α > 2 in some live row: the bisected model
        # a class that hides two keys in the support (counted): those two, fitted to its shares (`_two_keys`; from
        # fp32 sums, not exact: its step is confirmed by a pass)
        two = (k[:, None] < 1.0) & (hides > 1.5) & (hides < 2.5)
        d1, d2 = _two_keys(r, r1, k)
        a, c = tl.where(two, 1.0, a), tl.where(two, tau[:, None] + d1, c)
        a2, c2 = tl.where(two, 1.0, 0.0), tl.where(two, tau[:, None] + d2, tau[:, None])
        above = s0 > 1.0
        low = _class_bisection_root(
            xc, a, c, a2, c2, tl.where(above, tau, lo), tl.where(above, hi, tau),
            tl.where(above, s0 - 1.0, float("inf")), k,
        )  # fmt: skip
        model, exact = tl.where(k < 1.0, low, model), tl.where(k < 1.0, one, exact)
    return model, model_c2, exact


@triton.jit
def _threshold_step(
    tau, lo, hi, ptau, pfp, s0, s1, s2, inv, tol, dead, passes, max_passes, xc, FAST: tl.constexpr,
    MODELED: tl.constexpr,
):  # fmt: skip
    """One refinement of every row's τ after a sweep over the sums of _powers, and whether another sweep is needed
    (a row not converged, fewer than max_passes sweeps so far); (ptau, pfp): see _refine. MODELED: the sums come per
    key class (rows, classes), xc holds the classes' maxima (`_seed`), and Newton's rows, α > 2 and (where it is
    exact) Halley's rows step to the root of their class model (`_class_root`)."""
    k = tau * 0.0 + inv  # one per row (a program's rows may belong to several heads)
    if MODELED:
        c0, c1, counts, counted = _class_partials(s0, s1, s2, k, FAST)
        s0, s1, s2 = tl.sum(s0, 1), tl.sum(s1, 1), tl.max(s2, 1) if FAST == 1 else tl.sum(s2, 1)
    if FAST == 1:  # s2: minus the distance from τ to the row's nearest key (`_add_powers`)
        gap, s2 = -s2, tl.zeros_like(s2)
    else:
        gap = tl.zeros_like(s2)
    s0, s1, s2 = _power_sums(s0, s1, s2, inv, FAST)
    if MODELED:
        s2 = tl.where(k < 1.0, 0.0, s2)  # a count is no Σ d^(k+1): `_refine`'s far steps take the exponent k
        model, model_c2, exact = _class_root(xc, tau, lo, hi, c0, c1, counts, counted, s0, k, tol, dead)
    else:
        model, model_c2, exact = tau, tau, tau != tau
    tau, lo, hi, conv, ptau, pfp = _refine(
        tau, lo, hi, s0, s1, s2, inv, tol, ptau, pfp, model, model_c2, gap, exact, MODELED
    )  # fmt: skip
    passes += 1
    todo = (tl.sum(tl.where(conv | dead, 0, 1), 0) > 0) & (passes < max_passes)
    return tau, lo, hi, ptau, pfp, passes, todo


@triton.jit
def _bracket(umax, cnt, am1, keep):
    """Row shift (max u, 0 for a row with no key), τ's bracket [−1, −n^{1−α}] relative to it, and the rows that
    need no refinement (no visible key, or past Lq)."""
    dead = (umax == float("-inf")) | (keep == 0)
    shift = tl.where(umax == float("-inf"), 0.0, umax)
    lo = tl.zeros_like(umax) - 1.0
    hi = tl.where(cnt > 0, -tl.exp(-am1 * tl.log(tl.maximum(cnt, 1.0))), -1.0)
    return shift, lo, hi, dead


@triton.jit
def _seed(x, inv):
    """Where the threshold search starts: at or below the row's root, most often close to it. x (rows, classes): the
    maxima of u − max u over the row's key classes j ≡ c (mod classes), −inf where a class saw no key (prefill: the
    PARTIALS of `_entmax_tiles`' PASS 0; decode's threshold kernel: its BLOCK_N running maxima); inv: a scalar or one
    per row. Those maxima are keys of the row, so their S = Σ [x − τ]_+^inv never exceeds the row's, and a τ at which
    theirs is ≥ 1 lies at or below the row's root. Newton steps on S^(1/inv) − 1 (their S) from τ = −1, where their
    S ≥ 1 (the max is among them), keeping the last τ whose S ≥ 1: −1 for a row with no key. A sharp row, whose
    support is a few keys, starts on its root; a diffuse one a short way below it, where the bracket's low end has S
    of tens (α = 1.5, N(0, 1) logits: 3.7 → 2.4 threshold passes per program). The bracket is not moved: the first
    pass's sums place the seed in it. Per row only: no work per key."""
    tau = tl.zeros([x.shape[0]], dtype=tl.float32) - 1.0
    k = tau * 0.0 + inv  # one per row (a program's rows may belong to several heads)
    best = tau
    for _ in tl.static_range(SEED_STEPS):  # the last step is not evaluated, so not taken
        d = tl.maximum(x - tau[:, None], 0.0)
        lg = _log2(d)  # −inf where d = 0: d^k = 0 there (k > 0); d^(k−1) is selected
        s = tl.sum(tl.math.exp2(k[:, None] * lg), 1)
        s1 = tl.sum(tl.where(d > 0, tl.math.exp2((k[:, None] - 1.0) * lg), 0.0), 1)
        best = tl.where(s >= 1.0, tl.maximum(best, tau), best)
        tau = tau + s * (1.0 - tl.math.exp2(-_log2(s) / k)) / s1
    return best
