"""The softmax family (softmax, ssmax, SSA, adaptive): an online-softmax walk over a program's keys, kept in base 2,
with the entropy's running sum beside it; one launch finishes prefill, split-K decode writes partial states."""

from __future__ import annotations

import triton
import triton.language as tl

from sharp.plugins.triton.common import (
    LN2,
    NO_KEY,
    SUM_COLS,
    _entropy,
    _fold_sum,
    _folded_scales,
    _interior_end,
    _load_q,
    _program,
    _row_params,
    _signed_log2,
    _tile_pv,
    _tile_qk,
    _unit_column,
    _visible,
)


@triton.jit
def _sweep_tiles(
    state, start, end, q, K, V, k_offs, v_offs, skn, svn, cols0, qpos, LK, D, offs_d, scales, KMASK, E0,
    SSA: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_KMASK: tl.constexpr, WITH_V: tl.constexpr, ENTROPY: tl.constexpr, DOT_F32: tl.constexpr,
    MMA_SUMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Fold the key tiles of [start, end) into the base-2 row state: m (max u), Λ = Σ 2^{u−m}, K₂ = Σ 2^{u−m}(u − m)
    (ENTROPY), acc = Σ 2^{u−m} v. MASKED: keys ≥ Lk, causally hidden or absent (KMASK) read −inf — the diagonal and
    the last tile; otherwise every row sees every key of the tile but padding keys (HAS_KMASK: a column test).
    MMA_SUMS: Λ and K₂ are (rows, 8) column partials (their row sums), Λ's from P·E0 (E0 = e₀ in the inputs' type)
    — no row reduction per tile; otherwise row vectors. state: (m, Λ, K₂, acc); scales: the rows' factors (c, ca,
    ca·pos, g) of `_folded_scales`."""
    m_i, l_i, kp_i, acc = state
    c, ca, ca_pos, g = scales
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
        else:  # (rows, 8) column partials: Λ's on the tensor cores (p·e₀, as P·V sees p), K₂'s by FFMA chains
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
    q, K, V, KMASK, lo, hi, qpos, k_strides, v_strides, LK, D, scale, slope, lam, rowf, ssa_n, ssa_b,
    SSA: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_KMASK: tl.constexpr, WITH_V: tl.constexpr,
    ENTROPY: tl.constexpr, DOT_F32: tl.constexpr, MMA_SUMS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One online-softmax walk over keys [lo, hi) of K, V and KMASK (already offset to this batch and KV head):
    the whole tiles every row sees without any mask, then the rest (causal diagonal, last tile) with masks. Returns
    the row state in natural units: m (max t), Λ = Σ e^{t−m}, K' = Σ e^{t−m}(t − m) (0 without ENTROPY), acc.
    MMA_SUMS (half inputs only): Λ and K₂ kept as column partials in the walk (see _sweep_tiles)."""
    skn, skd = k_strides[2], k_strides[3]
    svn, svd = v_strides[2], v_strides[3]
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
        l_i = tl.zeros([BLOCK_M, SUM_COLS], dtype=tl.float32)
        kp_i = tl.zeros([BLOCK_M, SUM_COLS], dtype=tl.float32)
        E0 = _unit_column(BLOCK_N, V.dtype.element_ty)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        kp_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        E0 = 0.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, kp_i, acc = _sweep_tiles(
        (m_i, l_i, kp_i, acc), lo, full, qs, K, V, k_offs, v_offs, skn, svn, offs_n, qpos, LK, D, offs_d,
        (c, ca, ca_pos, g), KMASK, E0,
        SSA=SSA, MASKED=False, CAUSAL=CAUSAL, HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, WITH_V=WITH_V,
        ENTROPY=ENTROPY, DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    m_i, l_i, kp_i, acc = _sweep_tiles(
        (m_i, l_i, kp_i, acc), full, hi, qs, K, V, k_offs, v_offs, skn, svn, offs_n, qpos, LK, D, offs_d,
        (c, ca, ca_pos, g), KMASK, E0,
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
    Q, K, V, KMASK, q_strides, k_strides, v_strides, smb, NORM, scale, OUTS, sizes, split,
    SSA: tl.constexpr, HAS_ROWF: tl.constexpr, LOGN: tl.constexpr, ADAPTIVE: tl.constexpr, FINALIZE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    WITH_V: tl.constexpr, ENTROPY: tl.constexpr, DOT_F32: tl.constexpr, MMA_SUMS: tl.constexpr,
    PACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Online softmax over t = rowf·z (softmax; ssmax with LOGN: rowf = s_h·log n counted on chip; adaptive) or
    t = sgn(z) n log(1 + b|z|) (SSA), for BLOCK_M rows of one head over the key range of split pid_s.

    FINALIZE (one split: prefill): writes the normalised output (OUT, in its own dtype) and the entropy
    (ENT_OUT) — one launch per call. ADAPTIVE (with FINALIZE): a first sweep without V gives each row's softmax
    entropy H, β = max(poly(H), 1) where H > beta_threshold (else 1) is formed on chip, and the second sweep runs
    softmax(β·z) with V. Otherwise (split-K decode): writes the partial state of its split — m (max t),
    Λ = Σ e^{t−m}, K' = Σ e^{t−m}(t − m), acc = Σ e^{t−m} v — for the merge kernel. MMA_SUMS: the row sums on
    the tensor cores (half-precision prefill; not adaptive's output sweep with entropy, whose partials would spill).

    Program (query block, B·Hq, split) = program ids (0, 1, 2); PACKED (decode): (1, B·Hkv, split), the rows a KV
    head's queries (`_program`). Strides are (batch, head, position, dim) per tensor; smb: KMASK's batch stride.
    NORM: the norm's parameters (ROWF, SSMAX_S, SSA_N, SSA_B, SLOPES, LAMBDA, POLY, NPOLY, beta_threshold), read
    where a flag asks for them (POLY, NPOLY, beta_threshold: adaptive's β); OUTS: (OUT, ENT_OUT) and the split state
    (M_OUT, L_OUT, KP_OUT, ACC_OUT); sizes: (H, GROUP, LQ, LK, D); split: (BH, keys_per_split).
    """
    ROWF, SSMAX_S, SSA_N, SSA_B, SLOPES, LAMBDA, POLY, NPOLY, beta_threshold = NORM
    OUT, ENT_OUT, M_OUT, L_OUT, KP_OUT, ACC_OUT = OUTS
    H, GROUP, LQ, LK, D = sizes
    BH, keys_per_split = split
    pid_m, pid_bh, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h, hkv, offs_m, qpos, lo, hi = _program(
        pid_bh, pid_m, pid_s, H, GROUP, LQ, LK, keys_per_split, CAUSAL, PACKED, BLOCK_M
    )
    bh = b * H + h if PACKED else pid_bh  # each row's (B·Hq) index where the rows are a KV head's query heads
    offs_d = tl.arange(0, BLOCK_D)
    slope, lam = _row_params(SLOPES, LAMBDA, h, bh, offs_m, LQ, HAS_ALIBI, HAS_LAMBDA)
    rowf = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    if HAS_ROWF:
        rowf = tl.load(ROWF + bh * LQ + offs_m, mask=offs_m < LQ, other=1.0)
    if LOGN:
        rowf = tl.load(SSMAX_S + h) * tl.log(_visible_count(KMASK, b, smb, qpos, LK, CAUSAL, HAS_KMASK, BLOCK_N))
    ssa_n = 1.0
    ssa_b = 1.0
    if SSA:
        ssa_n = tl.load(SSA_N + h)
        ssa_b = tl.load(SSA_B + h)
    q = _load_q(Q, q_strides, b, h, offs_m, offs_d, LQ, D, DOT_F32, PACKED)
    K += b.to(tl.int64) * k_strides[0] + hkv * k_strides[1]
    V += b.to(tl.int64) * v_strides[0] + hkv * v_strides[1]
    KMASK += b * smb
    if ADAPTIVE:
        _, l1, kp1, _ = _softmax_sweep(
            q, K, V, KMASK, lo, hi, qpos, k_strides, v_strides, LK, D, scale, slope, lam, rowf, ssa_n, ssa_b,
            SSA=False, CAUSAL=CAUSAL, HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, WITH_V=False, ENTROPY=True,
            DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )  # fmt: skip
        h1 = _entropy(l1, kp1)
        beta = tl.zeros([BLOCK_M], dtype=tl.float32)
        for i in range(NPOLY):  # Horner, highest power first
            beta = beta * h1 + tl.load(POLY + i)
        rowf = tl.where(h1 > beta_threshold, tl.maximum(beta, 1.0), 1.0)
    m_i, l_i, kp_i, acc = _softmax_sweep(
        q, K, V, KMASK, lo, hi, qpos, k_strides, v_strides, LK, D, scale, slope, lam, rowf, ssa_n, ssa_b,
        SSA=SSA, CAUSAL=CAUSAL, HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, WITH_V=WITH_V, ENTROPY=ENTROPY,
        DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS and not (ADAPTIVE and ENTROPY), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
    )  # fmt: skip

    keep = offs_m < LQ
    if FINALIZE:
        row = bh * LQ + offs_m
        live = l_i > 0
        out = acc / tl.where(live, l_i, 1.0)[:, None]  # a row with no visible key has acc = 0: output 0
        tl.store(OUT + row[:, None] * BLOCK_D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=keep[:, None])
        if ENTROPY:
            tl.store(ENT_OUT + row, _entropy(l_i, kp_i), mask=keep)
    else:
        row = (pid_s * BH + bh) * LQ + offs_m
        tl.store(M_OUT + row, m_i, mask=keep)
        tl.store(L_OUT + row, l_i, mask=keep)
        tl.store(KP_OUT + row, kp_i, mask=keep)
        if WITH_V:
            tl.store(ACC_OUT + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=keep[:, None])


@triton.jit
def _softmax_family_kernel(
    Q, K, V, KMASK, q_strides, k_strides, v_strides, smb, NORM, scale, OUTS, sizes, split,
    SSA: tl.constexpr, HAS_ROWF: tl.constexpr, LOGN: tl.constexpr, ADAPTIVE: tl.constexpr, FINALIZE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    WITH_V: tl.constexpr, ENTROPY: tl.constexpr, DOT_F32: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Softmax family for torch tensors of any strides: grid (query blocks, B·Hq, key splits); the arguments as
    `_softmax_family_program` takes them, the row sums on the tensor cores in a half-precision prefill."""
    _softmax_family_program(
        Q, K, V, KMASK, q_strides, k_strides, v_strides, smb, NORM, scale, OUTS, sizes, split,
        SSA, HAS_ROWF, LOGN, ADAPTIVE, FINALIZE, CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, WITH_V, ENTROPY, DOT_F32,
        FINALIZE and not DOT_F32, PACKED, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
