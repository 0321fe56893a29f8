"""Triton kernels for the streamed normalizers (docs/attention.md); the host side is in `attention.py`.

Grid: (query blocks, B·Hq, key splits). A program owns BLOCK_M query rows of one head and the key range
of its split, walks that range in BLOCK_N tiles and writes *partial* per-row state; the host merges the
splits (one split for prefill, FlashAttention-2 style; many for decode, flash-decoding style). Masking is
explicit: rows ≥ Lq, keys ≥ Lk, head-dim lanes ≥ D and causally hidden keys all read as −inf logits or 0.

In the CPU interpreter a bf16 `tl.dot` does not work: DOT_F32 upcasts both operands and asks for IEEE fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    if DOT_F32:
        z = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        z = tl.dot(q, kt)
    z = z * scale
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
def _pv(p, v, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(p, v, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)


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
def _softmax_sweep(
    q, K, V, b, hkv, lo, hi, offs_n, offs_d, qpos, skb, skh, skn, skd, svb, svh, svn, svd, LK, D, scale, slope, lam,
    KMASK, smb, rowf, ssa_n, ssa_b, SSA: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr, WITH_V: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One online-softmax walk over keys [lo, hi): m (max t), Λ = Σ e^{t−m}, K' = Σ e^{t−m}(t − m),
    acc = Σ e^{t−m} v. Causal: the off-diagonal tiles — every key at or before the block's first query — run
    without the causal test, the diagonal tiles after them with it."""
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kp_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    mid = hi
    if CAUSAL:
        full_tiles = tl.maximum(tl.min(qpos, 0) + 1 - lo, 0) // BLOCK_N
        mid = tl.minimum(hi, lo + full_tiles * BLOCK_N)
    m_i, l_i, kp_i, acc = _sweep_range(
        m_i, l_i, kp_i, acc, lo, mid, q, K, V, b, hkv, offs_n, offs_d, qpos, skb, skh, skn, skd, svb, svh, svn, svd,
        LK, D, scale, slope, lam, KMASK, smb, rowf, ssa_n, ssa_b, SSA, False, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, WITH_V,
        DOT_F32, BLOCK_N,
    )  # fmt: skip
    if CAUSAL:
        m_i, l_i, kp_i, acc = _sweep_range(
            m_i, l_i, kp_i, acc, mid, hi, q, K, V, b, hkv, offs_n, offs_d, qpos, skb, skh, skn, skd, svb, svh, svn,
            svd, LK, D, scale, slope, lam, KMASK, smb, rowf, ssa_n, ssa_b, SSA, True, HAS_ALIBI, HAS_LAMBDA,
            HAS_KMASK, WITH_V, DOT_F32, BLOCK_N,
        )  # fmt: skip
    return m_i, l_i, kp_i, acc


@triton.jit
def _sweep_range(
    m_i, l_i, kp_i, acc, start, end, q, K, V, b, hkv, offs_n, offs_d, qpos, skb, skh, skn, skd, svb, svh, svn, svd,
    LK, D, scale, slope, lam, KMASK, smb, rowf, ssa_n, ssa_b, SSA: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr, WITH_V: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Fold the key tiles of [start, end) into the row state (CAUSAL: with the causal test)."""
    for start_n in range(start, end, BLOCK_N):
        z = _logits(
            q, K, b, hkv, start_n, offs_n, offs_d, qpos, skb, skh, skn, skd, LK, D, scale, slope, lam, KMASK, smb,
            CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, DOT_F32,
        )  # fmt: skip
        t = _transform(z, rowf, ssa_n, ssa_b, SSA)
        m_i, l_i, kp_i, r, e = _online_step(m_i, l_i, kp_i, t)
        if WITH_V:
            v = _load_v(V, b, hkv, start_n, offs_n, offs_d, svb, svh, svn, svd, LK, D, DOT_F32)
            acc = acc * r[:, None] + _pv(e, v, DOT_F32)
    return m_i, l_i, kp_i, acc


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
    WITH_V: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Online softmax over t = rowf·z (softmax; ssmax with LOGN: rowf = s_h·log n counted on chip; adaptive) or
    t = sgn(z) n log(1 + b|z|) (SSA), for BLOCK_M rows of one head over the key range of split pid_s.

    FINALIZE (one split: prefill): writes the normalised output (OUT, in its own dtype) and the entropy
    (ENT_OUT) — one launch per call. ADAPTIVE (with FINALIZE): a first sweep without V gives each row's softmax
    entropy H, β = max(poly(H), 1) where H > beta_threshold (else 1) is formed on chip, and the second sweep runs
    softmax(β·z) with V. Otherwise (split-K decode): writes the partial state of its split — m (max t),
    Λ = Σ e^{t−m}, K' = Σ e^{t−m}(t − m), acc = Σ e^{t−m} v — for the host to merge.
    """
    b, h, hkv, offs_m, qpos, lo, hi = _program(pid_bh, pid_m, pid_s, H, GROUP, LQ, LK, keys_per_split, CAUSAL, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
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
    if ADAPTIVE:
        _, l1, kp1, _ = _softmax_sweep(
            q, K, V, b, hkv, lo, hi, offs_n, offs_d, qpos, skb, skh, skn, skd, svb, svh, svn, svd, LK, D, scale,
            slope, lam, KMASK, smb, rowf, ssa_n, ssa_b, False, CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, False,
            DOT_F32, BLOCK_M, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        h1 = _entropy(l1, kp1)
        beta = tl.zeros([BLOCK_M], dtype=tl.float32)
        for i in range(NPOLY):  # Horner, highest power first
            beta = beta * h1 + tl.load(POLY + i)
        rowf = tl.where(h1 > beta_threshold, tl.maximum(beta, 1.0), 1.0)
    m_i, l_i, kp_i, acc = _softmax_sweep(
        q, K, V, b, hkv, lo, hi, offs_n, offs_d, qpos, skb, skh, skn, skd, svb, svh, svn, svd, LK, D, scale,
        slope, lam, KMASK, smb, rowf, ssa_n, ssa_b, SSA, CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, WITH_V,
        DOT_F32, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip

    keep = offs_m < LQ
    if FINALIZE:
        row = pid_bh * LQ + offs_m
        live = l_i > 0
        out = acc / tl.where(live, l_i, 1.0)[:, None]  # a row with no visible key has acc = 0: output 0
        tl.store(OUT + row[:, None] * BLOCK_D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=keep[:, None])
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
    WITH_V: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Softmax family for torch tensors of any strides: grid (query blocks, B·Hq, key splits)."""
    _softmax_family_program(
        Q, K, V, ROWF, SSMAX_S, SSA_N, SSA_B, POLY, SLOPES, LAMBDA, KMASK, M_OUT, L_OUT, KP_OUT, ACC_OUT, OUT,
        ENT_OUT, tl.program_id(0), tl.program_id(1), tl.program_id(2), sqb, sqh, sqm, sqd, skb, skh, skn, skd,
        svb, svh, svn, svd, H, GROUP, LQ, LK, D, BH, scale, keys_per_split, smb, NPOLY, beta_threshold,
        SSA, HAS_ROWF, LOGN, ADAPTIVE, FINALIZE, CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, WITH_V, DOT_F32,
        BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _powers(d, inv, FAST: tl.constexpr):
    """(d^inv, d^(inv−1), Σ-ready d^(inv−2)) for d ≥ 0, each 0 where d = 0. FAST = 2: inv = 2 (α = 1.5);
    FAST = 1: inv = 1 (α = 2) — no exp/log on the fast paths."""
    live = d > 0
    if FAST == 2:
        p0 = d * d
        p1 = d
        p2 = tl.where(live, 1.0, 0.0)
    elif FAST == 1:  # α = 2 takes Newton's step: S'' is not needed
        p0 = d
        p1 = tl.where(live, 1.0, 0.0)
        p2 = tl.zeros_like(d)
    else:
        logd = tl.log(tl.where(live, d, 1.0))
        p0 = tl.where(live, tl.exp(inv * logd), 0.0)
        p1 = tl.where(live, tl.exp((inv - 1.0) * logd), 0.0)
        p2 = tl.where(live, tl.exp((inv - 2.0) * logd), 0.0)
    return p0, p1, p2


@triton.jit
def _weights(d, inv, FAST: tl.constexpr):
    """w = d^inv and log w (0 where d = 0) for the output and its entropy."""
    live = d > 0
    logw = inv * tl.log(tl.where(live, d, 1.0))
    if FAST == 2:
        w = d * d
    elif FAST == 1:
        w = d
    else:
        w = tl.where(live, tl.exp(logw), 0.0)
    return w, logw


@triton.jit
def _refine(tau, lo, hi, s0, s1, s2, inv, tol):
    """One safeguarded root step for S(τ) = Σ d^inv = 1 per row (the streamed oracle's `refine_threshold`):
    Halley where S'' is bounded (α ≤ 1.5), Newton otherwise, bisection when the step leaves the bracket."""
    f = s0 - 1.0
    above = f > 0
    lo = tl.where(above, tau, lo)
    hi = tl.where(above, hi, tau)
    fp = -inv * s1
    fpp = inv * (inv - 1.0) * s2
    halley = 2.0 * f * fp / (2.0 * fp * fp - f * fpp)
    newton = f / fp
    cand = tau - tl.where(inv >= 2.0, halley, newton)
    ok = (cand == cand) & (tl.abs(cand) < float("inf")) & (cand >= lo) & (cand <= hi)
    # α > 2 (inv < 1): Newton can cycle between the bracket's ends; a step across over half of it bisects instead
    ok = ok & ((tl.zeros_like(tau) + inv >= 1.0) | (tl.abs(cand - tau) <= 0.5 * (hi - lo)))
    new = tl.where(ok, cand, 0.5 * (lo + hi))
    conv = (tl.abs(new - tau) <= tol) | (f == 0) | ((hi - lo) <= tol)
    return new, lo, hi, conv


@triton.jit
def _add_powers(s0, s1, s2, d, inv, FAST: tl.constexpr):
    """The threshold sums of one tile, added per row."""
    p0, p1, p2 = _powers(d, inv, FAST)
    return s0 + tl.sum(p0, 1), s1 + tl.sum(p1, 1), s2 + tl.sum(p2, 1)


@triton.jit
def _threshold_step(tau, lo, hi, s0, s1, s2, inv, tol, dead, passes, max_passes):
    """One refinement of every row's τ after a sweep, and whether another sweep is needed (a row not converged,
    fewer than max_passes sweeps so far)."""
    tau, lo, hi, conv = _refine(tau, lo, hi, s0, s1, s2, inv, tol)
    passes += 1
    todo = (tl.sum(tl.where(conv | dead, 0, 1), 0) > 0) & (passes < max_passes)
    return tau, lo, hi, passes, todo


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
def _entmax_program(
    Q, K, V, ALPHA, SLOPES, LAMBDA, KMASK, OUT, ENT_OUT, COUNTS,
    pid_m, pid_bh, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    H, GROUP, LQ, LK, D, scale, smb, max_passes, tol,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """α-entmax for BLOCK_M rows over all their keys, finished in the program: a max sweep (and visible-key count),
    safeguarded Halley/Newton threshold sweeps until every row has converged (at most max_passes; no host sync),
    and an output sweep that skips the V load and P·V of tiles with no support. Writes the output in OUT's dtype
    and the entropy; COUNT: also (threshold passes, skipped tiles) of the program."""
    b, h, hkv, offs_m, qpos, lo, hi = _program(pid_bh, pid_m, 0, H, GROUP, LQ, LK, LK, CAUSAL, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    slope, lam = _row_params(SLOPES, LAMBDA, h, pid_bh, offs_m, LQ, HAS_ALIBI, HAS_LAMBDA)
    am1 = tl.load(ALPHA + h) - 1.0
    inv = 1.0 / am1
    keep = offs_m < LQ
    q = _load_q(Q, b, h, offs_m, offs_d, sqb, sqh, sqm, sqd, LQ, D, DOT_F32)
    umax = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    cnt = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        z = _logits(
            q, K, b, hkv, start_n, offs_n, offs_d, qpos, skb, skh, skn, skd, LK, D, scale, slope, lam, KMASK, smb,
            CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, DOT_F32,
        )  # fmt: skip
        umax = tl.maximum(umax, tl.max(am1 * z, 1))
        cnt += tl.sum(tl.where(z > float("-inf"), 1.0, 0.0), 1)
    shift, t_lo, t_hi, dead = _bracket(umax, cnt, am1, keep)
    tau = t_lo
    passes = pid_m * 0
    todo = tl.sum(tl.where(dead, 0, 1), 0) > 0
    while todo:
        s0 = tl.zeros([BLOCK_M], dtype=tl.float32)
        s1 = tl.zeros([BLOCK_M], dtype=tl.float32)
        s2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            z = _logits(
                q, K, b, hkv, start_n, offs_n, offs_d, qpos, skb, skh, skn, skd, LK, D, scale, slope, lam, KMASK,
                smb, CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, DOT_F32,
            )  # fmt: skip
            d = tl.maximum((am1 * z - shift[:, None]) - tau[:, None], 0.0)
            if tl.max(tl.max(d, 1), 0) > 0:
                s0, s1, s2 = _add_powers(s0, s1, s2, d, inv, FAST)
        tau, t_lo, t_hi, passes, todo = _threshold_step(tau, t_lo, t_hi, s0, s1, s2, inv, tol, dead, passes, max_passes)
    zsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    plogp = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    skipped = pid_m * 0
    for start_n in range(lo, hi, BLOCK_N):
        z = _logits(
            q, K, b, hkv, start_n, offs_n, offs_d, qpos, skb, skh, skn, skd, LK, D, scale, slope, lam, KMASK, smb,
            CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, DOT_F32,
        )  # fmt: skip
        d = tl.maximum((am1 * z - shift[:, None]) - tau[:, None], 0.0)
        if tl.max(tl.max(d, 1), 0) > 0:
            w, logw = _weights(d, inv, FAST)
            zsum += tl.sum(w, 1)
            plogp += tl.sum(w * logw, 1)
            v = _load_v(V, b, hkv, start_n, offs_n, offs_d, svb, svh, svn, svd, LK, D, DOT_F32)
            acc += _pv(w, v, DOT_F32)
        else:
            skipped += 1
    live = zsum > 0
    safe = tl.where(live, zsum, 1.0)
    row = pid_bh * LQ + offs_m
    out = acc / safe[:, None]
    tl.store(OUT + row[:, None] * BLOCK_D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=keep[:, None])
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
    DOT_F32: tl.constexpr, FAST: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Entmax / ASEntmax with one key split (prefill): the whole computation in one launch (`_entmax_program`)."""
    _entmax_program(
        Q, K, V, ALPHA, SLOPES, LAMBDA, KMASK, OUT, ENT_OUT, COUNTS, tl.program_id(0), tl.program_id(1),
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, H, GROUP, LQ, LK, D, scale, smb, max_passes, tol,
        CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, DOT_F32, FAST, COUNT, BLOCK_M, BLOCK_N, BLOCK_D,
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
    tau = t_lo
    passes = pid * 0
    todo = tl.sum(tl.where(dead, 0, 1), 0) > 0
    while todo:
        a0 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        a1 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        for start_n in range(0, LK, BLOCK_N):
            cols = start_n + offs_n
            u = tl.load(
                U + rows[:, None] * LK + cols[None, :], mask=keep[:, None] & (cols[None, :] < LK), other=-float("inf")
            )
            p0, p1, p2 = _powers(tl.maximum((u - shift[:, None]) - tau[:, None], 0.0), inv[:, None], FAST)
            a0 += p0
            a1 += p1
            a2 += p2
        s0, s1, s2 = tl.sum(a0, 1), tl.sum(a1, 1), tl.sum(a2, 1)
        tau, t_lo, t_hi, passes, todo = _threshold_step(tau, t_lo, t_hi, s0, s1, s2, inv, tol, dead, passes, max_passes)
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
        d = tl.maximum((u - umax[:, None]) - tau[:, None], 0.0)
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """softmax, ssmax (LOGN), SSA, adaptive in TensorRT's argument order: one launch, grid (⌈Lq/BLOCK_M⌉, B·H)."""
    sqb, sqh, sqm, sqd = _contiguous_strides(H, LQ, BLOCK_D)
    skb, skh, skn, skd = _contiguous_strides(H // GROUP, LK, BLOCK_D)
    _softmax_family_program(
        Q, K, V, OUT, PARAMS + 4 * H, PARAMS + 2 * H, PARAMS + 3 * H, PARAMS + 5 * H, PARAMS, QSCALE, KMASK,
        OUT, OUT, OUT, OUT, OUT, ENT_OUT, tl.program_id(0), tl.program_id(1), 0,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, skb, skh, skn, skd,
        H, GROUP, LQ, LK, BLOCK_D, BH, scale_bits.to(tl.float32, bitcast=True), LK, LK, NPOLY,
        threshold_bits.to(tl.float32, bitcast=True),
        SSA, False, LOGN, ADAPTIVE, True, CAUSAL, True, False, True, True, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _trt_entmax_kernel(
    Q, K, V, KMASK, PARAMS, QSCALE,
    H, GROUP, LQ, LK, BH, scale_bits, NPOLY, threshold_bits, max_passes, tol_bits,
    OUT, ENT_OUT,
    HAS_LAMBDA: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """entmax, asentmax (HAS_LAMBDA: λ from QSCALE) in TensorRT's argument order: one launch."""
    sqb, sqh, sqm, sqd = _contiguous_strides(H, LQ, BLOCK_D)
    skb, skh, skn, skd = _contiguous_strides(H // GROUP, LK, BLOCK_D)
    _entmax_program(
        Q, K, V, PARAMS + H, PARAMS, QSCALE, KMASK, OUT, ENT_OUT, OUT, tl.program_id(0), tl.program_id(1),
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, skb, skh, skn, skd, H, GROUP, LQ, LK, BLOCK_D,
        scale_bits.to(tl.float32, bitcast=True), LK, max_passes, tol_bits.to(tl.float32, bitcast=True),
        CAUSAL, True, HAS_LAMBDA, True, DOT_F32, 0, False, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


KERNELS = {
    "softmax_family": _softmax_family_kernel,
    "entmax": _entmax_kernel,
    "entmax_logits": _entmax_logits_kernel,
    "entmax_threshold": _entmax_threshold_kernel,
    "entmax_output": _entmax_output_kernel,
    "trt_softmax_family": _trt_softmax_family_kernel,
    "trt_entmax": _trt_entmax_kernel,
}
