"""Triton kernels for the streamed normalizers (docs/attention.md); the host side is in `attention.py`.

Grid: (query blocks, B·Hq, key splits). A program owns BLOCK_M query rows of one head and the key range
of its split, walks that range in BLOCK_N tiles and writes *partial* per-row state; `_merge_softmax_kernel` merges
the splits (one split for prefill, FlashAttention-2 style; many for decode, flash-decoding style). Masking is
explicit: rows ≥ Lq, keys ≥ Lk, head-dim lanes ≥ D and causally hidden keys all read as −inf logits or 0.

In the CPU interpreter a bf16 `tl.dot` does not work: DOT_F32 upcasts both operands and asks for IEEE fp32.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)  # e^x = 2^(x·log2 e): the kernels work in base 2 (exp2 is one MUFU op)
LN2 = tl.constexpr(0.6931471805599453)
# The running max of a row that has seen no key yet: finite, so that 2^(m_old − m_new) is 0 and Λ·(m_old − m_new) is
# 0·finite (no −inf − −inf, no 0·∞) without a test per tile; it leaves a sweep as −inf.
NO_KEY = tl.constexpr(-3.0e38)
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
# Columns of the row sums kept as partials (MMA_SUMS): the narrowest N of an MMA.
PARTIALS = tl.constexpr(16)
# Columns of entmax's Σ w log2 d partials in the output sweep: down to 8, each halving of the tile's columns stays
# inside a thread (no shuffle) and the partials take 4 registers a thread; at PARTIALS columns the output loop spills.
LOG_PARTIALS = tl.constexpr(8)
# Triton's interpreter has no libdevice: the MUFU approximations fall back to NumPy there.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _program(pid_bh, pid_m, pid_s, H, GROUP, LQ, LK, keys_per_split, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """Indices of this program: batch, query head, KV head, query rows/positions, and its key range [lo, hi)."""
    b = pid_bh // H
    h = pid_bh % H
    hkv = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qpos = offs_m + (LK - LQ)  # query i sits at key position Lk − Lq + i
    lo = pid_s * keys_per_split
    hi = tl.minimum(lo + keys_per_split, LK)
    if CAUSAL:  # keys after the block's last query are invisible to all its rows
        hi = tl.minimum(hi, tl.minimum(pid_m * BLOCK_M + BLOCK_M, LQ) + (LK - LQ))
    return b, h, hkv, offs_m, qpos, lo, hi


@triton.jit
def _load_q(Q, b, h, offs_m, offs_d, sqb, sqh, sqm, sqd, LQ, D, DOT_F32: tl.constexpr):
    ptrs = Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd
    q = tl.load(ptrs, mask=(offs_m[:, None] < LQ) & (offs_d[None, :] < D), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _logits(
    q,
    K,
    b,
    hkv,
    start_n,
    offs_n,
    offs_d,
    qpos,
    skb,
    skh,
    skn,
    skd,
    LK,
    D,
    scale,
    slope,
    lam,
    KMASK,
    smb,
    CAUSAL: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_LAMBDA: tl.constexpr,
    HAS_KMASK: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """z (BLOCK_M, BLOCK_N) = λ · (scale · q·k + slope · (j − pos)), −inf where masked (causally, beyond Lk, or a
    padding key: KMASK (B, Lk) int8, 0 = absent)."""
    cols = start_n + offs_n
    kt_ptrs = K + b * skb + hkv * skh + cols[None, :] * skn + offs_d[:, None] * skd
    kt = tl.load(kt_ptrs, mask=(cols[None, :] < LK) & (offs_d[:, None] < D), other=0.0)
    z = _dot(q, kt, None, DOT_F32) * scale
    if HAS_ALIBI:
        z += slope * (cols[None, :] - qpos[:, None]).to(tl.float32)
    if HAS_LAMBDA:
        z = z * lam[:, None]
    visible = cols[None, :] < LK
    if HAS_KMASK:
        present = tl.load(KMASK + b * smb + cols, mask=cols < LK, other=0)
        visible = visible & (present[None, :] != 0)
    if CAUSAL:
        visible = visible & (cols[None, :] <= qpos[:, None])
    return tl.where(visible, z, float("-inf"))


@triton.jit
def _load_v(V, b, hkv, start_n, offs_n, offs_d, svb, svh, svn, svd, LK, D, DOT_F32: tl.constexpr):
    cols = start_n + offs_n
    ptrs = V + b * svb + hkv * svh + cols[:, None] * svn + offs_d[None, :] * svd
    v = tl.load(ptrs, mask=(cols[:, None] < LK) & (offs_d[None, :] < D), other=0.0)
    if DOT_F32:
        v = v.to(tl.float32)
    return v


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a·b on the tensor cores (acc None: a·b) — the one place the DOT_F32 rule is applied to a product: both
    operands in fp32 and the product in IEEE fp32 where DOT_F32 (the interpreter, fp32 inputs), else a rounded to
    b's type (a P or W tile to the inputs' half type; the shift columns already are)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a.to(b.dtype), b, acc)


@triton.jit
def _pv(p, v, DOT_F32: tl.constexpr):
    """p·v on the tensor cores (`_dot`)."""
    return _dot(p, v, None, DOT_F32)


@triton.jit
def _row_params(SLOPES, LAMBDA, h, pid_bh, offs_m, LQ, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr):
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h)
    lam = tl.zeros_like(offs_m).to(tl.float32) + 1.0
    if HAS_LAMBDA:
        lam = tl.load(LAMBDA + pid_bh * LQ + offs_m, mask=offs_m < LQ, other=1.0)
    return slope, lam


@triton.jit
def _log2(x):
    """log2 on the MUFU (lg2.approx: ~2^-22 relative error, one instruction); NumPy's in the interpreter."""
    if INTERPRETED:
        y = tl.log2(x)
    else:
        y = libdevice.fast_log2f(x)
    return y


@triton.jit
def _signed_log2(y):
    """sgn(y)·log2(1 + |y|): SSA's transform in base 2 (the sign copied bitwise)."""
    mag = _log2(1.0 + tl.abs(y))
    return (mag.to(tl.uint32, bitcast=True) | (y.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _folded_scales(scale, rowf, lam, ssa_n, ssa_b, SSA: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Per-row factors of the base-2 logits u = t·log2(e), with every per-row factor folded once.

    Softmax family: u = c·(q·k) + ca·(j − pos), c = log2(e)·rowf·λ·scale, ca = log2(e)·rowf·λ·slope (the caller
    multiplies by its slope); SSA: u = g·T(c·(q·k) + ca·(j − pos)), T(y) = sgn(y)·log2(1 + |y|), c = b·λ·scale.
    Without ALiBi the sign of a row's factor is returned to be folded into its query (exact: ±1), so c ≥ 0 and the
    row max of u is the factor times the max of q·k — one FFMA per element forms u − m. Returns (c, ca, g, sign)."""
    if SSA:
        c = ssa_b * lam * scale
        ca = ssa_b * lam
        g = lam * 0.0 + ssa_n
    else:
        c = LOG2E * rowf * lam * scale
        ca = LOG2E * rowf * lam
        g = tl.zeros_like(c) + 1.0  # a constant: u·g folds away
    if HAS_ALIBI:  # the slope term is per element: no folding, u formed in full
        if SSA:
            sgn = tl.where(g < 0, -1.0, 1.0)
            c, ca, g = c * sgn, ca * sgn, g * sgn
        sign = tl.zeros_like(c) + 1.0  # a constant: the query is used as loaded (it may stay in shared memory)
    elif SSA:
        sign = tl.where(c * g < 0, -1.0, 1.0)
        c, g = tl.abs(c), tl.abs(g)
    else:
        sign = tl.where(c < 0, -1.0, 1.0)
        c = tl.abs(c)
        g = c
    return c, ca, g, sign


@triton.jit
def _visible(cols, qpos, LK, KMASK, CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr):
    """Which keys of an edge tile each row sees: below Lk, causally at or before the row's position, present."""
    visible = cols[None, :] < LK
    if CAUSAL:
        visible = visible & (cols[None, :] <= qpos[:, None])
    if HAS_KMASK:
        visible = visible & (tl.load(KMASK + cols, mask=cols < LK, other=0) != 0)[None, :]
    return visible


@triton.jit
def _tile_qk(q, k_ptrs, cols, LK, D, offs_d, MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    """q·kᵀ of one key tile (k_ptrs: its (D, BLOCK_N) element pointers); only an edge tile masks keys ≥ Lk."""
    if MASKED:
        kt = tl.load(k_ptrs, mask=(cols[None, :] < LK) & (offs_d[:, None] < D), other=0.0)
    else:
        kt = tl.load(k_ptrs, mask=offs_d[:, None] < D, other=0.0)
    return _dot(q, kt, None, DOT_F32)


@triton.jit
def _tile_pv(acc, p, v_ptrs, cols, LK, D, offs_d, MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + p·v of one key tile, accumulated by the tensor cores; only an edge tile masks keys ≥ Lk."""
    if MASKED:
        v = tl.load(v_ptrs, mask=(cols[:, None] < LK) & (offs_d[None, :] < D), other=0.0)
    else:
        v = tl.load(v_ptrs, mask=offs_d[None, :] < D, other=0.0)
    return _dot(p, v, acc, DOT_F32)


@triton.jit
def _interior_end(lo, hi, qpos, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """The end of the whole BLOCK_N-key tiles from lo that every row of the block sees (no mask): below hi and,
    causally, at or before the block's first query."""
    full = lo + (hi - lo) // BLOCK_N * BLOCK_N
    if CAUSAL:
        full = tl.minimum(full, lo + tl.maximum(tl.min(qpos, 0) + 1 - lo, 0) // BLOCK_N * BLOCK_N)
    return full


@triton.jit
def _unit_column(BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """e₀ of the column partials, (BLOCK_N, PARTIALS) in `dtype`: W·e₀ puts each row's sum of W, as rounded to
    dtype (as W·V sees it), in column 0."""
    e0 = tl.where(tl.arange(0, PARTIALS) == 0, 1.0, 0.0)[None, :]
    return e0.broadcast_to([BLOCK_N, PARTIALS]).to(dtype)


# The shift columns' scales (`_shift_columns`): fp16's range ends at 65504, so its parts are taken at 2^11, 1 and
# 2^-11 (|max q·k| up to 1.3e8); bfloat16 and fp32 share fp32's range and take all three at 1.
SHIFT_SCALE_F16 = tl.constexpr(2048.0)


@triton.jit
def _shift_scale(dtype: tl.constexpr):
    if dtype == tl.float16:
        return SHIFT_SCALE_F16
    return 1.0


@triton.jit
def _shift_columns(s, dtype: tl.constexpr):
    """(rows, PARTIALS) query-side columns whose product with `_shift_rows` is −s per row: s split into three parts
    of `dtype` (s = a·M + b + c/M, M from `_shift_scale`; exact for fp32's 24 bits), so that a tile's Q·Kᵀ and this
    product, accumulated together by the tensor cores, give t − s (t − max t) in fp32 without a subtraction per
    element."""
    m = _shift_scale(dtype)
    a = (s / m).to(dtype)
    r = s - a.to(tl.float32) * m
    b = r.to(dtype)
    c = ((r - b.to(tl.float32)) * m).to(dtype)
    col = tl.arange(0, PARTIALS)[None, :]
    cols = tl.where(col == 0, -a.to(tl.float32)[:, None], 0.0)
    cols = tl.where(col == 1, -b.to(tl.float32)[:, None], cols)
    cols = tl.where(col == 2, -c.to(tl.float32)[:, None], cols)
    return cols.to(dtype)


@triton.jit
def _shift_rows(BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """The key side of `_shift_columns`: (PARTIALS, BLOCK_N) rows of M, 1 and 1/M over zeros (a constant)."""
    m = _shift_scale(dtype)
    row = tl.arange(0, PARTIALS)[:, None]
    rows = tl.where(row == 0, m, tl.where(row == 1, 1.0, tl.where(row == 2, 1.0 / m, 0.0)))
    return rows.broadcast_to([PARTIALS, BLOCK_N]).to(dtype)


@triton.jit
def _halves(t):
    """A (rows, n) tile's left and right column halves — held by the same threads in the MMA layouts."""
    return tl.split(tl.permute(tl.reshape(t, [t.shape[0], 2, t.shape[1] // 2]), (0, 2, 1)))


@triton.jit
def _fold_sum(acc, x):
    """acc + x with the (rows, n) tile folded into acc's (rows, PARTIALS) columns: one add per element (an FFMA with
    the product that forms x), where a row sum per tile would cost a tree of adds and shuffles across the row's
    threads."""
    if x.shape[1] == acc.shape[1]:
        acc = acc + x
    else:
        x0, x1 = _halves(x)
        acc = _fold_sum(_fold_sum(acc, x0), x1)
    return acc


@triton.jit
def _fold_max(acc, x):
    """max(acc, x) with the (rows, n) tile folded into acc's (rows, PARTIALS) columns, as `_fold_sum` adds: column c
    keeps the max of the row's keys j ≡ c (mod PARTIALS) — one compare per element and no shuffle, where a row max
    per tile took a tree of compares and shuffles across the row's threads."""
    if x.shape[1] == acc.shape[1]:
        acc = tl.maximum(acc, x)
    else:
        x0, x1 = _halves(x)
        acc = _fold_max(_fold_max(acc, x0), x1)
    return acc


@triton.jit
def _sweep_tiles(
    m_i, l_i, kp_i, acc, start, end, q, K, V, k_offs, v_offs, skn, svn, cols0, qpos, LK, D, offs_d, c, ca, ca_pos, g,
    KMASK, E0,
    SSA: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_KMASK: tl.constexpr, WITH_V: tl.constexpr, ENTROPY: tl.constexpr, DOT_F32: tl.constexpr,
    MMA_SUMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Fold the key tiles of [start, end) into the base-2 row state: m (max u), Λ = Σ 2^{u−m}, K₂ = Σ 2^{u−m}(u − m)
    (ENTROPY), acc = Σ 2^{u−m} v. MASKED: keys ≥ Lk, causally hidden or absent (KMASK) read −inf — the diagonal and
    the last tile; otherwise every row sees every key of the tile but padding keys (HAS_KMASK: a column test).
    MMA_SUMS: Λ and K₂ are (rows, 16) column partials (their row sums), Λ's from P·E0 (E0 = e₀ in the inputs' type)
    — no row reduction per tile; otherwise row vectors."""
    K += start * skn
    V += start * svn
    for start_n in range(start, end, BLOCK_N):
        cols = cols0 + start_n
        qk = _tile_qk(q, K + k_offs, cols, LK, D, offs_d, MASKED=MASKED, DOT_F32=DOT_F32)
        if HAS_ALIBI:  # slope·(j − pos) as slope·j − slope·pos: the row part is formed once (ca_pos)
            s = qk * c[:, None] + (ca[:, None] * cols.to(tl.float32)[None, :] - ca_pos[:, None])
            if SSA:
                s = _signed_log2(s)
        elif SSA:
            s = _signed_log2(qk * c[:, None])
        else:
            s = qk
        if MASKED or HAS_KMASK:
            if MASKED:
                visible = _visible(cols, qpos, LK, KMASK, CAUSAL=CAUSAL, HAS_KMASK=HAS_KMASK)
                u = tl.where(visible, s * g[:, None], float("-inf"))
            else:  # an interior tile: only padding keys are hidden, a per-key bias of 0 or −inf
                bias = tl.where(tl.load(KMASK + cols) != 0, 0.0, float("-inf"))
                u = s * g[:, None] + bias[None, :]
            m_new = tl.maximum(m_i, tl.max(u, 1))  # finite: m starts at NO_KEY, not −inf
            x = u - m_new[:, None]
            p = tl.math.exp2(x)
            if ENTROPY:  # a hidden key's x = −inf: made finite so that its p·x is 0, not NaN
                x = tl.maximum(x, -3.0e38)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * g)
            x = s * g[:, None] - m_new[:, None]
            p = tl.math.exp2(x)
        alpha = tl.math.exp2(m_i - m_new)
        # K₂ about the new max: the old terms shift by (m_old − m_new) each (Λ = 0 before any key)
        if not MMA_SUMS:  # row vectors, each tile's sums reduced across the row
            if ENTROPY:
                kp_i = alpha * (kp_i + l_i * (m_i - m_new)) + tl.sum(p * x, 1)
            l_i = l_i * alpha + tl.sum(p, 1)
        else:  # (rows, 16) column partials: Λ's on the tensor cores (p·e₀, as P·V sees p), K₂'s by FFMA chains
            if ENTROPY:
                kp_i = _fold_sum(kp_i * alpha[:, None] + l_i * (alpha * (m_i - m_new))[:, None], p * x)
            l_i = tl.dot(p.to(E0.dtype), E0, l_i * alpha[:, None])
        if WITH_V:
            acc = _tile_pv(acc * alpha[:, None], p, V + v_offs, cols, LK, D, offs_d, MASKED=MASKED, DOT_F32=DOT_F32)
        m_i = m_new
        K += BLOCK_N * skn
        V += BLOCK_N * svn
    return m_i, l_i, kp_i, acc


@triton.jit
def _softmax_sweep(
    q, K, V, KMASK, lo, hi, qpos, skn, skd, svn, svd, LK, D, scale, slope, lam, rowf, ssa_n, ssa_b,
    SSA: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_KMASK: tl.constexpr, WITH_V: tl.constexpr,
    ENTROPY: tl.constexpr, DOT_F32: tl.constexpr, MMA_SUMS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One online-softmax walk over keys [lo, hi) of K, V and KMASK (already offset to this batch and KV head):
    the whole tiles every row sees without any mask, then the rest (causal diagonal, last tile) with masks. Returns
    the row state in natural units: m (max t), Λ = Σ e^{t−m}, K' = Σ e^{t−m}(t − m) (0 without ENTROPY), acc.
    MMA_SUMS (half inputs only): Λ and K₂ kept as column partials in the walk (see _sweep_tiles)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    c, ca, g, sign = _folded_scales(scale, rowf, lam, ssa_n, ssa_b, SSA=SSA, HAS_ALIBI=HAS_ALIBI)
    ca = ca * slope
    ca_pos = ca * qpos.to(tl.float32)
    qs = q * sign[:, None].to(q.dtype)
    k_offs = offs_n[None, :] * skn + offs_d[:, None] * skd  # a tile's offsets from its first key: loop-invariant
    v_offs = offs_n[:, None] * svn + offs_d[None, :] * svd
    full = _interior_end(lo, hi, qpos, CAUSAL, BLOCK_N)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NO_KEY
    if MMA_SUMS:  # column partials; E0 = e₀ in V's type: P·E0 sums P as P·V sees it
        l_i = tl.zeros([BLOCK_M, PARTIALS], dtype=tl.float32)
        kp_i = tl.zeros([BLOCK_M, PARTIALS], dtype=tl.float32)
        E0 = _unit_column(BLOCK_N, V.dtype.element_ty)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        kp_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        E0 = 0.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, kp_i, acc = _sweep_tiles(
        m_i, l_i, kp_i, acc, lo, full, qs, K, V, k_offs, v_offs, skn, svn, offs_n, qpos, LK, D, offs_d, c, ca, ca_pos,
        g, KMASK, E0,
        SSA=SSA, MASKED=False, CAUSAL=CAUSAL, HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, WITH_V=WITH_V,
        ENTROPY=ENTROPY, DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    m_i, l_i, kp_i, acc = _sweep_tiles(
        m_i, l_i, kp_i, acc, full, hi, qs, K, V, k_offs, v_offs, skn, svn, offs_n, qpos, LK, D, offs_d, c, ca, ca_pos,
        g, KMASK, E0,
        SSA=SSA, MASKED=True, CAUSAL=CAUSAL, HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, WITH_V=WITH_V,
        ENTROPY=ENTROPY, DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    if MMA_SUMS:
        l_i = tl.sum(l_i, 1)
        kp_i = tl.sum(kp_i, 1)
    return tl.where(l_i > 0, m_i * LN2, float("-inf")), l_i, kp_i * LN2, acc


@triton.jit
def _transform(z, rowf, ssa_n, ssa_b, SSA: tl.constexpr):
    """t = sgn(z)·n·log(1 + b|z|) (SSA; n, b scalars or (rows, 1) columns) or rowf·z; −inf stays −inf."""
    masked = z == float("-inf")
    zs = tl.where(masked, 0.0, z)
    if SSA:
        mag = tl.log(1.0 + ssa_b * tl.abs(zs))
        t = ssa_n * tl.where(zs >= 0, mag, -mag)
    else:
        t = rowf[:, None] * zs
    return tl.where(masked, float("-inf"), t)


@triton.jit
def _online_step(m_i, l_i, kp_i, t):
    """Fold a tile of transformed logits t (−inf where masked) into the row state (m, Λ, K'); returns the new
    state, the rescale r of the old accumulator and the tile's weights e = e^{t−m}."""
    m_new = tl.maximum(m_i, tl.max(t, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    r = tl.exp(m_i - m_safe)
    e = tl.exp(t - m_safe[:, None])
    rel = tl.where(e > 0, t - m_safe[:, None], 0.0)
    dm = tl.where(l_i > 0, m_i - m_safe, 0.0)  # never 0 · (−inf): rows with no key yet have Λ = 0
    kp_i = r * (kp_i + l_i * dm) + tl.sum(e * rel, 1)
    l_i = r * l_i + tl.sum(e, 1)
    return m_new, l_i, kp_i, r, e


@triton.jit
def _entropy(l_i, kp_i):
    """H = log Λ − K'/Λ of the finished row; 0 for a row that saw no key."""
    live = l_i > 0
    safe = tl.where(live, l_i, 1.0)
    return tl.where(live, tl.log(safe) - kp_i / safe, 0.0)


@triton.jit
def _visible_count(KMASK, b, smb, qpos, LK, CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """n per row: the keys it sees (ssmax's log n), at least 1 for a row that sees only padding — as
    `AttentionProblem.visible_keys`. With a key mask it is counted from the mask (int loads only)."""
    if HAS_KMASK:
        offs_n = tl.arange(0, BLOCK_N)
        n = tl.zeros(qpos.shape, dtype=tl.float32)
        for start_n in range(0, LK, BLOCK_N):
            cols = start_n + offs_n
            present = tl.load(KMASK + b * smb + cols, mask=cols < LK, other=0) != 0
            seen = present[None, :] & (cols[None, :] < LK)
            if CAUSAL:
                seen = seen & (cols[None, :] <= qpos[:, None])
            n += tl.sum(tl.where(seen, 1.0, 0.0), 1)
        n = tl.maximum(n, 1.0)
    elif CAUSAL:
        n = (qpos + 1).to(tl.float32)
    else:
        n = tl.zeros(qpos.shape, dtype=tl.float32) + LK
    return n


@triton.jit
def _softmax_family_program(
    Q, K, V, ROWF, SSMAX_S, SSA_N, SSA_B, POLY, SLOPES, LAMBDA, KMASK, M_OUT, L_OUT, KP_OUT, ACC_OUT, OUT, ENT_OUT,
    pid_m, pid_bh, pid_s, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    H, GROUP, LQ, LK, D, BH, scale, keys_per_split, smb, NPOLY, beta_threshold,
    SSA: tl.constexpr, HAS_ROWF: tl.constexpr, LOGN: tl.constexpr, ADAPTIVE: tl.constexpr, FINALIZE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    WITH_V: tl.constexpr, ENTROPY: tl.constexpr, DOT_F32: tl.constexpr, MMA_SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Online softmax over t = rowf·z (softmax; ssmax with LOGN: rowf = s_h·log n counted on chip; adaptive) or
    t = sgn(z) n log(1 + b|z|) (SSA), for BLOCK_M rows of one head over the key range of split pid_s.

    FINALIZE (one split: prefill): writes the normalised output (OUT, in its own dtype) and the entropy
    (ENT_OUT) — one launch per call. ADAPTIVE (with FINALIZE): a first sweep without V gives each row's softmax
    entropy H, β = max(poly(H), 1) where H > beta_threshold (else 1) is formed on chip, and the second sweep runs
    softmax(β·z) with V. Otherwise (split-K decode): writes the partial state of its split — m (max t),
    Λ = Σ e^{t−m}, K' = Σ e^{t−m}(t − m), acc = Σ e^{t−m} v — for the merge kernel. MMA_SUMS: the row sums on
    the tensor cores (half-precision prefill; not adaptive's output sweep with entropy, whose partials would spill).
    """
    b, h, hkv, offs_m, qpos, lo, hi = _program(pid_bh, pid_m, pid_s, H, GROUP, LQ, LK, keys_per_split, CAUSAL, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    slope, lam = _row_params(SLOPES, LAMBDA, h, pid_bh, offs_m, LQ, HAS_ALIBI, HAS_LAMBDA)
    rowf = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    if HAS_ROWF:
        rowf = tl.load(ROWF + pid_bh * LQ + offs_m, mask=offs_m < LQ, other=1.0)
    if LOGN:
        rowf = tl.load(SSMAX_S + h) * tl.log(_visible_count(KMASK, b, smb, qpos, LK, CAUSAL, HAS_KMASK, BLOCK_N))
    ssa_n = 1.0
    ssa_b = 1.0
    if SSA:
        ssa_n = tl.load(SSA_N + h)
        ssa_b = tl.load(SSA_B + h)
    q = _load_q(Q, b, h, offs_m, offs_d, sqb, sqh, sqm, sqd, LQ, D, DOT_F32)
    K += b.to(tl.int64) * skb + hkv * skh
    V += b.to(tl.int64) * svb + hkv * svh
    KMASK += b * smb
    if ADAPTIVE:
        _, l1, kp1, _ = _softmax_sweep(
            q, K, V, KMASK, lo, hi, qpos, skn, skd, svn, svd, LK, D, scale, slope, lam, rowf, ssa_n, ssa_b,
            SSA=False, CAUSAL=CAUSAL, HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, WITH_V=False, ENTROPY=True,
            DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )  # fmt: skip
        h1 = _entropy(l1, kp1)
        beta = tl.zeros([BLOCK_M], dtype=tl.float32)
        for i in range(NPOLY):  # Horner, highest power first
            beta = beta * h1 + tl.load(POLY + i)
        rowf = tl.where(h1 > beta_threshold, tl.maximum(beta, 1.0), 1.0)
    m_i, l_i, kp_i, acc = _softmax_sweep(
        q, K, V, KMASK, lo, hi, qpos, skn, skd, svn, svd, LK, D, scale, slope, lam, rowf, ssa_n, ssa_b,
        SSA=SSA, CAUSAL=CAUSAL, HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, WITH_V=WITH_V, ENTROPY=ENTROPY,
        DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS and not (ADAPTIVE and ENTROPY), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
    )  # fmt: skip

    keep = offs_m < LQ
    if FINALIZE:
        row = pid_bh * LQ + offs_m
        live = l_i > 0
        out = acc / tl.where(live, l_i, 1.0)[:, None]  # a row with no visible key has acc = 0: output 0
        tl.store(OUT + row[:, None] * BLOCK_D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=keep[:, None])
        if ENTROPY:
            tl.store(ENT_OUT + row, _entropy(l_i, kp_i), mask=keep)
    else:
        row = (pid_s * BH + pid_bh) * LQ + offs_m
        tl.store(M_OUT + row, m_i, mask=keep)
        tl.store(L_OUT + row, l_i, mask=keep)
        tl.store(KP_OUT + row, kp_i, mask=keep)
        if WITH_V:
            tl.store(ACC_OUT + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=keep[:, None])


@triton.jit
def _softmax_family_kernel(
    Q, K, V, ROWF, SSMAX_S, SSA_N, SSA_B, POLY, SLOPES, LAMBDA, KMASK, M_OUT, L_OUT, KP_OUT, ACC_OUT, OUT, ENT_OUT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    H, GROUP, LQ, LK, D, BH, scale, keys_per_split, smb, NPOLY, beta_threshold,
    SSA: tl.constexpr, HAS_ROWF: tl.constexpr, LOGN: tl.constexpr, ADAPTIVE: tl.constexpr, FINALIZE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    WITH_V: tl.constexpr, ENTROPY: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Softmax family for torch tensors of any strides: grid (query blocks, B·Hq, key splits)."""
    _softmax_family_program(
        Q, K, V, ROWF, SSMAX_S, SSA_N, SSA_B, POLY, SLOPES, LAMBDA, KMASK, M_OUT, L_OUT, KP_OUT, ACC_OUT, OUT,
        ENT_OUT, tl.program_id(0), tl.program_id(1), tl.program_id(2), sqb, sqh, sqm, sqd, skb, skh, skn, skd,
        svb, svh, svn, svd, H, GROUP, LQ, LK, D, BH, scale, keys_per_split, smb, NPOLY, beta_threshold,
        SSA, HAS_ROWF, LOGN, ADAPTIVE, FINALIZE, CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, WITH_V, ENTROPY,
        DOT_F32, FINALIZE and not DOT_F32, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


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
    """A tile's Σ w per row: MMA_SUMS, as (rows, 16) column partials formed by the tensor cores from w as P·V sees it
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


@triton.jit
def _entmax_tiles(
    umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped, start, end, q, qx, kx, K, V, k_offs, v_offs, skn, svn, cols0,
    qpos, LK, D, offs_d, cf, ca, ca_pos, KMASK, shift, tau, inv, E0,
    PASS: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_KMASK: tl.constexpr, FAST: tl.constexpr, DOT_F32: tl.constexpr, MMA_SUMS: tl.constexpr,
    ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One entmax pass over the key tiles of [start, end) with u = cf·t, t = q·k (cf = (α−1)·λ·scale ≥ 0 per row,
    its sign folded into q) or, with ALiBi, t = u = cf·q·k + (α−1)·λ·slope·(j − pos) formed in full. PASS 0: the
    maxima of t over the row's key classes j ≡ c (mod PARTIALS) (umax, (rows, PARTIALS): see `_seed`) and, with a
    key mask, the visible keys (cnt); 1: the threshold sums at τ (s0, s1, s2); 2:
    the output sums (zsum, plogp, acc; a tile with no weight skips its V load and P·V; plogp only with ENTROPY).
    MASKED: the diagonal and the last tile (causally hidden and out-of-range keys); padding keys (HAS_KMASK) are
    tested on every tile."""
    K += start * skn
    V += start * svn
    for start_n in range(start, end, BLOCK_N):
        cols = cols0 + start_n
        t = _tile_qk(q, K + k_offs, cols, LK, D, offs_d, MASKED=MASKED, DOT_F32=DOT_F32)
        if HAS_ALIBI:
            t = t * cf[:, None] + (ca[:, None] * cols.to(tl.float32)[None, :] - ca_pos[:, None])
        elif PASS != 0:  # t − max t, the row's shift accumulated with Q·Kᵀ by the tensor cores
            t = _dot(qx, kx, t, DOT_F32)
        if MASKED or HAS_KMASK:
            if MASKED:
                visible = _visible(cols, qpos, LK, KMASK, CAUSAL=CAUSAL, HAS_KMASK=HAS_KMASK)
            else:  # an interior tile: only padding keys are hidden
                visible = (tl.load(KMASK + cols, mask=cols < LK, other=0) != 0)[None, :]
            t = tl.where(visible, t, float("-inf"))
            if PASS == 0 and HAS_KMASK:
                cnt += tl.sum(tl.where(visible, 1.0, 0.0), 1)
        if PASS == 0:
            umax = _fold_max(umax, t)
        else:
            if HAS_ALIBI:  # always on in the TensorRT form, whose ASEntmax output loop spills with the saturating form
                d = tl.maximum((t - shift[:, None]) - tau[:, None], 0.0)
            else:  # cf·(t − max t) − τ in one FFMA.SAT: τ is not rounded to max u's ulp
                d = _support(t * cf[:, None], tau[:, None])
            if PASS == 1:
                gap = d
                if FAST == 1:  # −|x − τ| (see _add_powers)
                    if HAS_ALIBI:
                        gap = -tl.abs((t - shift[:, None]) - tau[:, None])
                    else:
                        gap = -tl.abs(t * cf[:, None] - tau[:, None])
                s0, s1, s2 = _add_powers(s0, s1, s2, d, gap, inv, FAST, MMA_SUMS)
            else:
                # A tile whose weights are all 0 skips its V load and P·V. On interior tiles the test reads the tile's
                # Z — formed on the tensor cores as P·V sees w (`_tile_z`) — from (rows, 16) partials, where one on d
                # took a reduction per element. The edge tiles and the TensorRT form (ALiBi on) test d before forming
                # w: with w formed first, their loops spill (the edge's under Triton 3.9, TensorRT's under 3.6).
                if MASKED or HAS_ALIBI:
                    live = tl.max(tl.max(d, 1), 0) > 0
                else:
                    w, lg = _output_weights(d, inv, FAST, ENTROPY)
                    zt = _tile_z(w, E0, MMA_SUMS)
                    live = tl.max(zt) > 0
                if live:
                    if MASKED or HAS_ALIBI:
                        w, lg = _output_weights(d, inv, FAST, ENTROPY)
                        zt = _tile_z(w, E0, MMA_SUMS)
                    zsum += zt
                    if ENTROPY:  # Σ w log₂ d (× inv·ln 2 once at the end); MMA_SUMS: into column partials
                        plogp = _fold_sum(plogp, w * lg) if MMA_SUMS else plogp + tl.sum(w * lg, 1)
                    acc = _tile_pv(acc, w, V + v_offs, cols, LK, D, offs_d, MASKED=MASKED, DOT_F32=DOT_F32)
                else:
                    skipped += 1
        K += BLOCK_N * skn
        V += BLOCK_N * svn
    return umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped


@triton.jit
def _entmax_pass(
    umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped, lo, full, hi, q, qx, kx, K, V, k_offs, v_offs, skn, svn,
    cols0,
    qpos, LK, D, offs_d, cf, ca, ca_pos, KMASK, shift, tau, inv, E0,
    PASS: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_KMASK: tl.constexpr,
    FAST: tl.constexpr, DOT_F32: tl.constexpr, MMA_SUMS: tl.constexpr, BLOCK_N: tl.constexpr,
    ENTROPY: tl.constexpr = True,
):  # fmt: skip
    """One pass over the program's keys: the interior tiles [lo, full) without masks, then [full, hi) with them."""
    umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped = _entmax_tiles(
        umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped, lo, full, q, qx, kx, K, V, k_offs, v_offs, skn, svn, cols0,
        qpos, LK, D, offs_d, cf, ca, ca_pos, KMASK, shift, tau, inv, E0, PASS=PASS, MASKED=False, CAUSAL=CAUSAL,
        HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, FAST=FAST, DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS, ENTROPY=ENTROPY,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped = _entmax_tiles(
        umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped, full, hi, q, qx, kx, K, V, k_offs, v_offs, skn, svn, cols0,
        qpos, LK, D, offs_d, cf, ca, ca_pos, KMASK, shift, tau, inv, E0, PASS=PASS, MASKED=True, CAUSAL=CAUSAL,
        HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, FAST=FAST, DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS, ENTROPY=ENTROPY,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped


@triton.jit
def _entmax_program(
    Q, K, V, ALPHA, SLOPES, LAMBDA, KMASK, OUT, ENT_OUT, COUNTS,
    pid_m, pid_bh, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    H, GROUP, LQ, LK, D, scale, smb, max_passes, tol,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, COUNT: tl.constexpr, MMA_SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWEEP_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ENTROPY: tl.constexpr,
):  # fmt: skip
    """α-entmax for BLOCK_M rows over all their keys, finished in the program: a max sweep (which also finds where
    the search starts: `_seed`), safeguarded Halley/Newton threshold sweeps until every row has converged (at most
    max_passes; no host sync), and an output sweep that skips the V load and P·V of tiles with no support.
    u = (α−1)·z is formed as one per-row factor times q·k (its sign folded into the query) except with ALiBi; every
    sweep walks the interior tiles without masks.
    The visible-key count is the causal limit (or Lk) unless a key mask is given. Writes the output in OUT's dtype
    and, with ENTROPY, the entropy (without it the output sweep forms no log w and no Σ w log w); COUNT: also
    (threshold passes, skipped tiles) of the program. The threshold sums are kept per key class (rows, PARTIALS);
    Newton's rows (1.5 < α ≤ 2), α > 2 and, where the pass's count shows the model exact, Halley's rows step to their
    class model's root (`_class_root`), the class maxima held across the threshold loop (under Triton 3.6 the general
    path launches with 2 pipeline stages to hold them without a spill: `attention.entmax_stages`; the TensorRT form
    does not spill in its key loops at 2). The max and threshold sweeps,
    which carry no V and no P·V, walk SWEEP_N-key tiles (the torch path: twice BLOCK_N, up to 128 — half the
    loop, pointer, barrier and query-reload work per key; the TensorRT form keeps BLOCK_N: wider, it spills).
    MMA_SUMS (half-precision inputs, both forms): their sums, and the output's Z, as (rows, 16) column partials (see
    _sweep_tiles). The search starts at `_seed`'s τ, not at the bracket's low end (the TensorRT form seeded without
    its class model spilled a register in its output loop under Triton 3.9; with it, none)."""
    b, h, hkv, offs_m, qpos, lo, hi = _program(pid_bh, pid_m, 0, H, GROUP, LQ, LK, LK, CAUSAL, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    slope, lam = _row_params(SLOPES, LAMBDA, h, pid_bh, offs_m, LQ, HAS_ALIBI, HAS_LAMBDA)
    am1 = tl.load(ALPHA + h) - 1.0
    inv = 1.0 / am1
    keep = offs_m < LQ
    q = _load_q(Q, b, h, offs_m, offs_d, sqb, sqh, sqm, sqd, LQ, D, DOT_F32)
    c = am1 * lam * scale
    ca = am1 * lam * slope
    ca_pos = ca * qpos.to(tl.float32)
    if HAS_ALIBI:  # u formed in full per element
        sign = c * 0.0 + 1.0
        cf = c
    else:
        sign = tl.where(c < 0, -1.0, 1.0)
        cf = tl.abs(c)
    qs = q * sign[:, None].to(q.dtype)
    K += b.to(tl.int64) * skb + hkv * skh
    V += b.to(tl.int64) * svb + hkv * svh
    KMASK += b * smb
    k_offs = offs_n[None, :] * skn + offs_d[:, None] * skd
    v_offs = offs_n[:, None] * svn + offs_d[None, :] * svd
    full = _interior_end(lo, hi, qpos, CAUSAL, BLOCK_N)
    offs_s = tl.arange(0, SWEEP_N)
    k_offs_s = offs_s[None, :] * skn + offs_d[:, None] * skd
    full_s = _interior_end(lo, hi, qpos, CAUSAL, SWEEP_N)
    zero = tl.zeros([BLOCK_M], dtype=tl.float32)
    sums = tl.zeros([BLOCK_M, PARTIALS], dtype=tl.float32)  # the threshold sums per key class (the class model's)
    if MMA_SUMS:
        E0 = _unit_column(BLOCK_N, V.dtype.element_ty)
        zsum0 = sums
    else:
        E0 = 0.0
        zsum0 = zero
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    skipped = pid_m * 0
    umax_c, cnt, _, _, _, _, _, _, _ = _entmax_pass(
        tl.zeros([BLOCK_M, PARTIALS], dtype=tl.float32) - float("inf"), zero, zero, zero, zero, zero, zero, acc,
        skipped, lo, full_s, hi, qs, qs, qs, K, V, k_offs_s, v_offs, skn, svn, offs_s, qpos, LK, D, offs_d, cf, ca,
        ca_pos, KMASK, zero, zero, inv, E0, PASS=0,
        CAUSAL=CAUSAL, HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, FAST=FAST, DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS,
        BLOCK_N=SWEEP_N,
    )  # fmt: skip
    umax = tl.max(umax_c, 1)
    top = tl.where(umax == float("-inf"), 0.0, umax)
    if not HAS_ALIBI:
        qx = _shift_columns(top, qs.dtype)  # max t: see _entmax_tiles
        kx_s, kx = _shift_rows(SWEEP_N, qs.dtype), _shift_rows(BLOCK_N, qs.dtype)
        umax = umax * cf  # the max of c·t is c times the max of t: c ≥ 0
        x_c = tl.where(umax_c == float("-inf"), float("-inf"), (umax_c - top[:, None]) * cf[:, None])
    else:
        qx, kx_s, kx = qs, qs, qs
        x_c = umax_c - top[:, None]
    if not HAS_KMASK:  # every key up to the causal limit (or Lk) is visible
        if CAUSAL:
            cnt = tl.minimum(tl.maximum(qpos + 1, 0), LK).to(tl.float32)
        else:
            cnt = zero + LK
    shift, t_lo, t_hi, dead = _bracket(umax, cnt, am1, keep)
    tau = _seed(x_c, inv)
    ptau, pfp = tau, tl.zeros_like(tau)
    # The general path's threshold sweep needs b = d^e with e > 0 (0 exactly where d = 0, no select); a head whose
    # e ≤ 0 (α = 1.5 among per-head α, or α ≥ 2) walks its keys in the selecting sweep instead. The two run one after
    # the other, each over an empty range where the other is taken (sequential loops share their shared-memory
    # buffers; the arms of an `if` would not).
    selected = (FAST == 0) & (_power_exponent(inv) <= 0.0)
    full_f, hi_f = tl.where(selected, lo, full_s), tl.where(selected, lo, hi)
    full_g, hi_g = tl.where(selected, full_s, lo), tl.where(selected, hi, lo)
    passes = pid_m * 0
    todo = tl.sum(tl.where(dead, 0, 1), 0) > 0
    gaps = sums - float("inf") if FAST == 1 else sums  # α = 2's s2 is a max (`_add_powers`)
    while todo:
        _, _, s0, s1, s2, _, _, _, _ = _entmax_pass(
            umax, cnt, sums, sums, gaps, zero, zero, acc, skipped, lo, full_f, hi_f, qs, qx, kx_s, K, V, k_offs_s,
            v_offs, skn, svn, offs_s, qpos, LK, D, offs_d, cf, ca, ca_pos, KMASK, shift, tau, inv, E0, PASS=1,
            CAUSAL=CAUSAL,
            HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, FAST=FAST, DOT_F32=DOT_F32, MMA_SUMS=True,
            BLOCK_N=SWEEP_N,
        )  # fmt: skip
        if FAST == 0:  # the same sums where e ≤ 0 (an empty key range elsewhere)
            _, _, s0, s1, s2, _, _, _, _ = _entmax_pass(
                umax, cnt, s0, s1, s2, zero, zero, acc, skipped, lo, full_g, hi_g, qs, qx, kx_s, K, V, k_offs_s, v_offs,
                skn, svn, offs_s, qpos, LK, D, offs_d, cf, ca, ca_pos, KMASK, shift, tau, inv, E0, PASS=1,
                CAUSAL=CAUSAL,
                HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, FAST=GENERAL_SELECTED,
                DOT_F32=DOT_F32, MMA_SUMS=True,
                BLOCK_N=SWEEP_N,
            )  # fmt: skip
        tau, t_lo, t_hi, ptau, pfp, passes, todo = _threshold_step(
            tau, t_lo, t_hi, ptau, pfp, s0, s1, s2, inv, tol, dead, passes, max_passes, x_c, FAST, True
        )
    plogp0 = tl.zeros([BLOCK_M, LOG_PARTIALS], dtype=tl.float32) if MMA_SUMS else zero
    _, _, _, _, _, zsum, plogp, acc, skipped = _entmax_pass(
        umax, cnt, zero, zero, zero, zsum0, plogp0, acc, skipped, lo, full, hi, qs, qx, kx, K, V, k_offs, v_offs, skn,
        svn, offs_n, qpos, LK, D, offs_d, cf, ca, ca_pos, KMASK, shift, tau, inv, E0, PASS=2, CAUSAL=CAUSAL,
        HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, FAST=FAST, DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS,
        BLOCK_N=BLOCK_N, ENTROPY=ENTROPY,
    )  # fmt: skip
    if MMA_SUMS:
        zsum, plogp = tl.sum(zsum, 1), tl.sum(plogp, 1)
    live = zsum > 0
    safe = tl.where(live, zsum, 1.0)
    row = pid_bh * LQ + offs_m
    out = acc / safe[:, None]
    tl.store(OUT + row[:, None] * BLOCK_D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=keep[:, None])
    if ENTROPY:
        plogp = plogp * (inv * LN2)
        tl.store(ENT_OUT + row, tl.where(live, tl.log(safe) - plogp / safe, 0.0), mask=keep)
    if COUNT:
        slot = COUNTS + (pid_bh * tl.cdiv(LQ, BLOCK_M) + pid_m) * 2
        tl.store(slot, passes)
        tl.store(slot + 1, skipped)


@triton.jit
def _entmax_kernel(
    Q, K, V, ALPHA, SLOPES, LAMBDA, KMASK, OUT, ENT_OUT, COUNTS,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    H, GROUP, LQ, LK, D, scale, smb, max_passes, tol,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, COUNT: tl.constexpr, ENTROPY: tl.constexpr, EXACT_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Entmax / ASEntmax with one key split (prefill): the whole computation in one launch (`_entmax_program`,
    seeded and stepping to its class model's root); without ENTROPY (a caller that does not ask for it) ENT_OUT is
    not written. EXACT_D: D = BLOCK_D (as in the TensorRT form), so no load masks head-dim lanes — a masked load
    under a branch (the output sweep's V) zeroes its registers first. Under Triton 3.6 the general path (FAST = 0)
    launches with at most 2 pipeline stages (`attention.entmax_stages`)."""
    _entmax_program(
        Q, K, V, ALPHA, SLOPES, LAMBDA, KMASK, OUT, ENT_OUT, COUNTS, tl.program_id(0), tl.program_id(1),
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, H, GROUP, LQ, LK, BLOCK_D if EXACT_D else D,
        scale, smb, max_passes, tol,
        CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, DOT_F32, FAST, COUNT, not DOT_F32, BLOCK_M, BLOCK_N,
        min(2 * BLOCK_N, 128), BLOCK_D, ENTROPY,
    )  # fmt: skip


@triton.jit
def _entmax_logits_kernel(
    Q, K, ALPHA, SLOPES, LAMBDA, KMASK, U_OUT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd,
    H, GROUP, LQ, LK, D, scale, keys_per_split, smb,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Split-K entmax decode, step 1: u = (α−1) z of this split's keys into U (B·Hq, Lq, Lk) fp32 (−inf where
    masked), so the threshold kernel reads 4 bytes per logit instead of recomputing Q·Kᵀ every pass."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h, hkv, offs_m, qpos, lo, hi = _program(pid_bh, pid_m, pid_s, H, GROUP, LQ, LK, keys_per_split, CAUSAL, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    slope, lam = _row_params(SLOPES, LAMBDA, h, pid_bh, offs_m, LQ, HAS_ALIBI, HAS_LAMBDA)
    am1 = tl.load(ALPHA + h) - 1.0
    q = _load_q(Q, b, h, offs_m, offs_d, sqb, sqh, sqm, sqd, LQ, D, DOT_F32)
    keep = offs_m < LQ
    row = pid_bh * LQ + offs_m
    end = tl.minimum(pid_s * keys_per_split + keys_per_split, LK)
    for start_n in range(lo, end, BLOCK_N):
        cols = start_n + offs_n
        if start_n < hi:
            z = _logits(
                q, K, b, hkv, start_n, offs_n, offs_d, qpos, skb, skh, skn, skd, LK, D, scale, slope, lam, KMASK,
                smb, CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, DOT_F32,
            )  # fmt: skip
            u = am1 * z
        else:  # causally hidden from every row of the block
            u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) - float("inf")
        tl.store(U_OUT + row[:, None] * LK + cols[None, :], u, mask=keep[:, None] & (cols[None, :] < end))


@triton.jit
def _entmax_threshold_kernel(
    U, ALPHA, UMAX_OUT, TAU_OUT, COUNTS, H, LQ, LK, ROWS, max_passes, tol,
    FAST: tl.constexpr, COUNT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Split-K entmax decode, step 2: each row's max u and τ from U, the same safeguarded refinement as the
    fused kernel, iterated on chip until the program's rows converge — no host sync between passes."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    keep = rows < ROWS
    am1 = tl.load(ALPHA + (rows // LQ) % H, mask=keep, other=2.0) - 1.0
    inv = 1.0 / am1
    offs_n = tl.arange(0, BLOCK_N)
    # Element-wise accumulators reduced once after each sweep: a row reduction inside these loops makes Triton 3.6's
    # TritonGPUOptimizeThreadLocality pass fail once LK and the pointers are specialised as divisible by 16 (what the
    # JIT does on a GPU); it is also fewer shuffles per tile.
    umax = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32) - float("inf")
    cnt = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for start_n in range(0, LK, BLOCK_N):
        cols = start_n + offs_n
        u = tl.load(
            U + rows[:, None] * LK + cols[None, :], mask=keep[:, None] & (cols[None, :] < LK), other=-float("inf")
        )
        umax = tl.maximum(umax, u)
        cnt += tl.where(u > float("-inf"), 1.0, 0.0)
    shift, t_lo, t_hi, dead = _bracket(tl.max(umax, 1), tl.sum(cnt, 1), am1, keep)
    x_c = umax - shift[:, None]  # the maxima of the row's BLOCK_N key classes
    tau = _seed(x_c, inv)
    ptau, pfp = tau, tl.zeros_like(tau)
    passes = pid * 0
    todo = tl.sum(tl.where(dead, 0, 1), 0) > 0
    while todo:
        a0 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        a1 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32) - (float("inf") if FAST == 1 else 0.0)
        for start_n in range(0, LK, BLOCK_N):
            cols = start_n + offs_n
            u = tl.load(
                U + rows[:, None] * LK + cols[None, :], mask=keep[:, None] & (cols[None, :] < LK), other=-float("inf")
            )
            d = _support(u - shift[:, None], tau[:, None])  # rows of several heads: any e, selected
            p0, p1, p2 = _powers(d, inv[:, None], GENERAL_SELECTED if FAST == 0 else FAST)
            a0 += p0
            a1 += p1
            if FAST == 1:  # −|x − τ| (see _add_powers)
                a2 = tl.maximum(a2, -tl.abs((u - shift[:, None]) - tau[:, None]))
            else:
                a2 += p2
        if FAST == 2:  # the class model (FAST ≠ 2) reads the sums per class: the BLOCK_N columns
            a0, a1, a2 = tl.sum(a0, 1), tl.sum(a1, 1), tl.sum(a2, 1)
        tau, t_lo, t_hi, ptau, pfp, passes, todo = _threshold_step(
            tau, t_lo, t_hi, ptau, pfp, a0, a1, a2, inv, tol, dead, passes, max_passes, x_c, FAST, FAST != 2
        )
    tl.store(UMAX_OUT + rows, shift, mask=keep)
    tl.store(TAU_OUT + rows, tau, mask=keep)
    if COUNT:
        tl.store(COUNTS + pid, passes)


@triton.jit
def _entmax_output_kernel(
    U, V, ALPHA, UMAX, TAU, Z_OUT, PLOGP_OUT, ACC_OUT, SKIPPED_OUT,
    svb, svh, svn, svd,
    H, GROUP, LQ, LK, D, BH, keys_per_split,
    CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, FAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Split-K entmax decode, step 3: w = [(u − max u) − τ]_+^{1/(α−1)} from the u that step 1 wrote (the τ of step 2
    was found on exactly these values: recomputing Q·Kᵀ here would round u differently — an FMA — and at α > 2 the
    weights near the threshold are that sensitive; it also reads 4 bytes per logit instead of K); partial Σ w,
    Σ w log w, Σ w v per split (summed on the device by the host's tensor ops). Key tiles where every w is 0 skip the
    V load and the second matmul; their count is written per program."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h, hkv, offs_m, _, lo, hi = _program(pid_bh, pid_m, pid_s, H, GROUP, LQ, LK, keys_per_split, CAUSAL, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    inv = 1.0 / (tl.load(ALPHA + h) - 1.0)
    keep = offs_m < LQ
    row = pid_bh * LQ + offs_m
    umax = tl.load(UMAX + row, mask=keep, other=0.0)  # (u − max u) − τ: the sum would round τ to max u's ulp
    tau = tl.load(TAU + row, mask=keep, other=0.0)
    zsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    plogp = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    skipped = 0
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        u = tl.load(
            U + row[:, None] * LK + cols[None, :], mask=keep[:, None] & (cols[None, :] < LK), other=-float("inf")
        )
        d = _support(u - umax[:, None], tau[:, None])
        if tl.max(tl.max(d, 1), 0) > 0:
            w, logw = _weights(d, inv, FAST)
            zsum += tl.sum(w, 1)
            plogp += tl.sum(w * logw, 1)
            v = _load_v(V, b, hkv, start_n, offs_n, offs_d, svb, svh, svn, svd, LK, D, DOT_F32)
            acc += _pv(w, v, DOT_F32)
        else:
            skipped += 1
    out_row = (pid_s * BH + pid_bh) * LQ + offs_m
    tl.store(Z_OUT + out_row, zsum, mask=keep)
    tl.store(PLOGP_OUT + out_row, plogp, mask=keep)
    tl.store(ACC_OUT + out_row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=keep[:, None])
    n_qblocks = tl.cdiv(LQ, BLOCK_M)
    tl.store(SKIPPED_OUT + (pid_s * BH + pid_bh) * n_qblocks + pid_m, skipped)


# ---- TensorRT entry points -------------------------------------------------------------------------------------
# TensorRT launches an AOT plugin kernel with the plugin's input pointers, then its int32 extra arguments, then its
# output pointers (Triton's two hidden scratch pointers last, passed as null). These wrappers take exactly that
# order for the TensorRT form of the op (docs/tensorrt.md): contiguous (B, H, L, D) tensors whose head dim is the
# compile-time BLOCK_D, an int32 key mask, every per-head parameter packed in one fp32 PARAMS vector
# [slopes, alpha, ssa_n, ssa_b, ssmax_s] (H each) followed by the adaptive polynomial, and float scalars as int32
# bit patterns. Both take the same extras, so one launch contract serves every norm.


@triton.jit
def _contiguous_strides(H, L, D: tl.constexpr):
    """Strides (b, h, l, d) of a contiguous (B, H, L, D) tensor; the batch stride in int64 (it passes 2^31)."""
    return H.to(tl.int64) * L * D, L * D, D, 1


@triton.jit
def _trt_softmax_family_kernel(
    Q, K, V, KMASK, PARAMS, QSCALE,
    H, GROUP, LQ, LK, BH, scale_bits, NPOLY, threshold_bits, max_passes, tol_bits,
    OUT, ENT_OUT,
    SSA: tl.constexpr, LOGN: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
    MMA_SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """softmax, ssmax (LOGN), SSA, adaptive in TensorRT's argument order: one launch, grid (⌈Lq/BLOCK_M⌉, B·H).
    MMA_SUMS: the row sums as column partials in half precision, as the host's compiler favours (aot.py)."""
    sqb, sqh, sqm, sqd = _contiguous_strides(H, LQ, BLOCK_D)
    skb, skh, skn, skd = _contiguous_strides(H // GROUP, LK, BLOCK_D)
    _softmax_family_program(
        Q, K, V, OUT, PARAMS + 4 * H, PARAMS + 2 * H, PARAMS + 3 * H, PARAMS + 5 * H, PARAMS, QSCALE, KMASK,
        OUT, OUT, OUT, OUT, OUT, ENT_OUT, tl.program_id(0), tl.program_id(1), 0,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, skb, skh, skn, skd,
        H, GROUP, LQ, LK, BLOCK_D, BH, scale_bits.to(tl.float32, bitcast=True), LK, LK, NPOLY,
        threshold_bits.to(tl.float32, bitcast=True),
        SSA, False, LOGN, ADAPTIVE, True, CAUSAL, True, False, True, True, True, DOT_F32, MMA_SUMS and not DOT_F32,
        BLOCK_M, BLOCK_N,
        BLOCK_D,
    )  # fmt: skip


@triton.jit
def _trt_entmax_kernel(
    Q, K, V, KMASK, PARAMS, QSCALE,
    H, GROUP, LQ, LK, BH, scale_bits, NPOLY, threshold_bits, max_passes, tol_bits,
    OUT, ENT_OUT,
    HAS_LAMBDA: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """entmax, asentmax (HAS_LAMBDA: λ from QSCALE) in TensorRT's argument order: one launch, seeded and stepping to
    its class model's root as the torch path's does. Every head's threshold sweep selects its powers and counts the
    support at α > 2 (GENERAL_SELECTED): a second, select-free sweep for the heads that allow it makes this form's
    output loop spill."""
    sqb, sqh, sqm, sqd = _contiguous_strides(H, LQ, BLOCK_D)
    skb, skh, skn, skd = _contiguous_strides(H // GROUP, LK, BLOCK_D)
    _entmax_program(
        Q, K, V, PARAMS + H, PARAMS, QSCALE, KMASK, OUT, ENT_OUT, OUT, tl.program_id(0), tl.program_id(1),
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, skb, skh, skn, skd, H, GROUP, LQ, LK, BLOCK_D,
        scale_bits.to(tl.float32, bitcast=True), LK, max_passes, tol_bits.to(tl.float32, bitcast=True),
        CAUSAL, True, HAS_LAMBDA, True, DOT_F32, GENERAL_SELECTED, False, not DOT_F32, BLOCK_M, BLOCK_N, BLOCK_N,
        BLOCK_D, True,
    )  # fmt: skip


@triton.jit
def _merge_softmax_kernel(
    M, L, KPS, ACC, OUT, ENT_OUT, ROWS, SPLITS,
    WITH_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge per-split states (m, Λ, K', acc) of ROWS rows: rescale to the global max, sum, and finish the output
    (OUT's dtype) and the entropy H = log Λ − K'/Λ (0 for a row that saw no key). Split-K and paged decode's last
    step: one launch where tensor ops took about twenty."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    keep = rows < ROWS
    offs_d = tl.arange(0, BLOCK_D)
    top = tl.zeros([BLOCK_R], dtype=tl.float32) - float("inf")
    for s in range(SPLITS):
        top = tl.maximum(top, tl.load(M + s * ROWS + rows, mask=keep, other=-float("inf")))
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    l_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    kp_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s in range(SPLITS):
        m = tl.load(M + s * ROWS + rows, mask=keep, other=-float("inf"))
        lam = tl.load(L + s * ROWS + rows, mask=keep, other=0.0)
        w = tl.where(lam > 0, tl.exp(m - top_safe), 0.0)
        shift = tl.where(lam > 0, m - top_safe, 0.0)
        l_sum += w * lam
        kp_sum += w * (tl.load(KPS + s * ROWS + rows, mask=keep, other=0.0) + lam * shift)
        if WITH_V:
            part = tl.load(ACC + (s * ROWS + rows)[:, None] * BLOCK_D + offs_d[None, :], mask=keep[:, None], other=0.0)
            acc += w[:, None] * part
    tl.store(ENT_OUT + rows, _entropy(l_sum, kp_sum), mask=keep)
    if WITH_V:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(OUT + rows[:, None] * BLOCK_D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=keep[:, None])


KERNELS = {
    "softmax_family": _softmax_family_kernel,
    "entmax": _entmax_kernel,
    "entmax_logits": _entmax_logits_kernel,
    "entmax_threshold": _entmax_threshold_kernel,
    "entmax_output": _entmax_output_kernel,
    "merge_softmax": _merge_softmax_kernel,
    "trt_softmax_family": _trt_softmax_family_kernel,
    "trt_entmax": _trt_entmax_kernel,
}
