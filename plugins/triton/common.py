"""The kernels' shared pieces: a program's rows and key range, tile loads and products, the per-row logit
factors, the masks, and the column partials that keep row sums and maxima on the tensor cores (`_fold_sum`).

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
# Columns of the entmax threshold sums' key classes and of the shift product's depth (an MMA's K is at least 16).
PARTIALS = tl.constexpr(16)
# Columns of the row sums kept as partials (MMA_SUMS: Λ, K₂, entmax's Σ w): the narrowest N of an MMA. The constant
# e₀ block behind Λ's product is then (BLOCK_N, 8): at 16 its 2 KB put the softmax family's prefill 1 KB over what
# lets two programs share an SM.
SUM_COLS = tl.constexpr(8)
# Triton's interpreter has no libdevice: the MUFU approximations fall back to NumPy there.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _program(
    pid_bh, pid_m, pid_s, H, GROUP, LQ, LK, keys_per_split, CAUSAL: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Indices of this program: batch, query head, KV head, each row's query index and key position, and its key
    range [lo, hi). Grid (query blocks, B·Hq, splits): the rows are BLOCK_M queries of head pid_bh. PACKED (decode),
    grid (1, B·Hkv, splits): row r is query r % Lq of head hkv·GROUP + r // Lq — the KV head's GROUP × Lq queries in
    one program, so each key and value is read once for all of them; h is then per row (the caller's b·H + h takes
    pid_bh's place in row indices), and a row past GROUP·Lq gets query index Lq (every load and store masks it)."""
    if PACKED:
        kv_heads = H // GROUP
        b = pid_bh // kv_heads
        hkv = pid_bh % kv_heads
        r = tl.arange(0, BLOCK_M)
        live = r < GROUP * LQ
        h = hkv * GROUP + tl.where(live, r // LQ, 0)
        offs_m = tl.where(live, r % LQ, LQ)
    else:
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
def _load_q(Q, q_strides, b, h, offs_m, offs_d, LQ, D, DOT_F32: tl.constexpr, PACKED: tl.constexpr = False):
    """The block's queries (BLOCK_M, BLOCK_D), 0 beyond Lq and D; q_strides: (batch, head, position, dim); h: the
    program's head, or each row's (PACKED: `_program`)."""
    sqb, sqh, sqm, sqd = q_strides
    if PACKED:
        ptrs = Q + b * sqb + (h * sqh + offs_m * sqm)[:, None] + offs_d[None, :] * sqd
    else:
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
    k_strides,
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
    """z (BLOCK_M, BLOCK_N) = λ · (scale · q·k + slope · (j − pos)) (slope: a scalar or a (rows, 1) column), −inf
    where masked (causally, beyond Lk, or a padding key: KMASK (B, Lk) int8, 0 = absent)."""
    skb, skh, skn, skd = k_strides
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
def _load_v(V, v_strides, b, hkv, start_n, offs_n, offs_d, LK, D, DOT_F32: tl.constexpr):
    """A key tile's values (BLOCK_N, BLOCK_D), 0 beyond Lk and D; v_strides: (batch, head, position, dim)."""
    svb, svh, svn, svd = v_strides
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
    """The ALiBi slope of head h and each row's λ; h and pid_bh (b·H + h) are the program's, or each row's
    (PACKED: `_program`)."""
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
    """e₀ of the column partials, (BLOCK_N, SUM_COLS) in `dtype`: W·e₀ puts each row's sum of W, as rounded to
    dtype (as W·V sees it), in column 0."""
    e0 = tl.where(tl.arange(0, SUM_COLS) == 0, 1.0, 0.0)[None, :]
    return e0.broadcast_to([BLOCK_N, SUM_COLS]).to(dtype)


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
def _entropy(l_i, kp_i):
    """H = log Λ − K'/Λ of the finished row; 0 for a row that saw no key."""
    live = l_i > 0
    safe = tl.where(live, l_i, 1.0)
    return tl.where(live, tl.log(safe) - kp_i / safe, 0.0)
