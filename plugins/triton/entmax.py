"""α-entmax and ASEntmax prefill: max, threshold and output sweeps over a program's keys in one launch."""

from __future__ import annotations

import triton
import triton.language as tl

from sharp.plugins.triton.common import (
    LN2,
    PARTIALS,
    SUM_COLS,
    _dot,
    _fold_max,
    _fold_sum,
    _interior_end,
    _load_q,
    _program,
    _row_params,
    _shift_columns,
    _shift_rows,
    _tile_pv,
    _tile_qk,
    _unit_column,
    _visible,
)
from sharp.plugins.triton.threshold import (
    GENERAL_SELECTED,
    _add_powers,
    _bracket,
    _output_weights,
    _power_exponent,
    _seed,
    _support,
    _threshold_step,
    _tile_z,
)

# Columns of entmax's Σ w log2 d partials in the output sweep: down to 8, each halving of the tile's columns stays
# inside a thread (no shuffle) and the partials take 4 registers a thread; at PARTIALS columns the output loop spills.
LOG_PARTIALS = tl.constexpr(8)


@triton.jit
def _entmax_tiles(
    state, start, end, qs, K, V, k_offs, v_offs, skn, svn, cols0, qpos, LK, D, offs_d, scales, KMASK, search, E0,
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
    tested on every tile. state: (umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped); qs: the query tile and the
    shift product's operands (q, qx, kx); scales: the rows' (cf, ca, ca·pos); search: (shift, τ, inv)."""
    umax, cnt, s0, s1, s2, zsum, plogp, acc, skipped = state
    q, qx, kx = qs
    cf, ca, ca_pos = scales
    shift, tau, inv = search
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
                # Z — formed on the tensor cores as P·V sees w (`_tile_z`) — from (rows, 8) partials, where one on d
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
    state, lo, full, hi, qs, K, V, k_offs, v_offs, skn, svn, cols0, qpos, LK, D, offs_d, scales, KMASK, search, E0,
    PASS: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_KMASK: tl.constexpr,
    FAST: tl.constexpr, DOT_F32: tl.constexpr, MMA_SUMS: tl.constexpr, BLOCK_N: tl.constexpr,
    ENTROPY: tl.constexpr = True,
):  # fmt: skip
    """One pass over the program's keys: the interior tiles [lo, full) without masks, then [full, hi) with them
    (the arguments as `_entmax_tiles` takes them)."""
    state = _entmax_tiles(
        state, lo, full, qs, K, V, k_offs, v_offs, skn, svn, cols0, qpos, LK, D, offs_d, scales, KMASK, search, E0,
        PASS=PASS, MASKED=False, CAUSAL=CAUSAL,
        HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, FAST=FAST, DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS, ENTROPY=ENTROPY,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    state = _entmax_tiles(
        state, full, hi, qs, K, V, k_offs, v_offs, skn, svn, cols0, qpos, LK, D, offs_d, scales, KMASK, search, E0,
        PASS=PASS, MASKED=True, CAUSAL=CAUSAL,
        HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, FAST=FAST, DOT_F32=DOT_F32, MMA_SUMS=MMA_SUMS, ENTROPY=ENTROPY,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return state


@triton.jit
def _entmax_program(
    Q, K, V, KMASK, ALPHA, SLOPES, LAMBDA, OUT, ENT_OUT, COUNTS, q_strides, k_strides, v_strides, smb, sizes, scale,
    stop,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, COUNT: tl.constexpr, MMA_SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWEEP_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ENTROPY: tl.constexpr,
):  # fmt: skip
    """α-entmax for BLOCK_M rows over all their keys, finished in the program, in three kinds of sweep:

    1. a max sweep: each row's max of u = (α−1)·z per key class (PARTIALS classes, j mod PARTIALS), from which
       `_seed` starts the search near the root instead of at the bracket's low end;
    2. threshold sweeps until every row has converged (at most max_passes, no host synchronisation): each gives the
       sums of the support's powers per key class, and `_threshold_step` takes a safeguarded Halley / Newton step,
       or steps to the class model's root (`_class_root`) where that model is exact or the path asks for it;
    3. an output sweep that skips the V load and P·V of tiles with no support.

    u is one per-row factor times q·k (its sign folded into the query) except with ALiBi, where it is formed in full.
    Every sweep walks the interior tiles without masks. The max and threshold sweeps carry no V: they walk SWEEP_N
    keys a tile (wider tiles, less loop and pointer work per key). MMA_SUMS (half-precision inputs): their sums and
    the output's Σ w as (rows, 8) column partials (see `_sweep_tiles`). The visible-key count is the causal limit (or
    Lk) unless a key mask is given. Writes the output in OUT's dtype and, with ENTROPY, the entropy (without it the
    output sweep forms no log w); COUNT: also (threshold passes, skipped tiles) of the program. Which of these
    choices each compiled form needs to stay free of spills is in docs/kernels.md.

    Program (query block, B·H) = program ids (0, 1). Strides are (batch, head, position, dim) per tensor; smb:
    KMASK's batch stride; sizes: (H, GROUP, LQ, LK, D); stop: the search's (max_passes, tol)."""
    H, GROUP, LQ, LK, D = sizes
    max_passes, tol = stop
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    skn, skd = k_strides[2], k_strides[3]
    svn, svd = v_strides[2], v_strides[3]
    b, h, hkv, offs_m, qpos, lo, hi = _program(pid_bh, pid_m, 0, H, GROUP, LQ, LK, LK, CAUSAL, False, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    slope, lam = _row_params(SLOPES, LAMBDA, h, pid_bh, offs_m, LQ, HAS_ALIBI, HAS_LAMBDA)
    am1 = tl.load(ALPHA + h) - 1.0
    inv = 1.0 / am1
    keep = offs_m < LQ
    q = _load_q(Q, q_strides, b, h, offs_m, offs_d, LQ, D, DOT_F32)
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
    K += b.to(tl.int64) * k_strides[0] + hkv * k_strides[1]
    V += b.to(tl.int64) * v_strides[0] + hkv * v_strides[1]
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
        zsum0 = tl.zeros([BLOCK_M, SUM_COLS], dtype=tl.float32)
    else:
        E0 = 0.0
        zsum0 = zero
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    skipped = pid_m * 0
    umax_c, cnt, _, _, _, _, _, _, _ = _entmax_pass(
        (tl.zeros([BLOCK_M, PARTIALS], dtype=tl.float32) - float("inf"), zero, zero, zero, zero, zero, zero, acc,
         skipped), lo, full_s, hi, (qs, qs, qs), K, V, k_offs_s, v_offs, skn, svn, offs_s, qpos, LK, D, offs_d,
        (cf, ca, ca_pos), KMASK, (zero, zero, inv), E0, PASS=0,
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
            (umax, cnt, sums, sums, gaps, zero, zero, acc, skipped), lo, full_f, hi_f, (qs, qx, kx_s), K, V, k_offs_s,
            v_offs, skn, svn, offs_s, qpos, LK, D, offs_d, (cf, ca, ca_pos), KMASK, (shift, tau, inv), E0, PASS=1,
            CAUSAL=CAUSAL,
            HAS_ALIBI=HAS_ALIBI, HAS_KMASK=HAS_KMASK, FAST=FAST, DOT_F32=DOT_F32, MMA_SUMS=True,
            BLOCK_N=SWEEP_N,
        )  # fmt: skip
        if FAST == 0:  # the same sums where e ≤ 0 (an empty key range elsewhere)
            _, _, s0, s1, s2, _, _, _, _ = _entmax_pass(
                (umax, cnt, s0, s1, s2, zero, zero, acc, skipped), lo, full_g, hi_g, (qs, qx, kx_s), K, V, k_offs_s,
                v_offs, skn, svn, offs_s, qpos, LK, D, offs_d, (cf, ca, ca_pos), KMASK, (shift, tau, inv), E0, PASS=1,
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
        (umax, cnt, zero, zero, zero, zsum0, plogp0, acc, skipped), lo, full, hi, (qs, qx, kx), K, V, k_offs, v_offs,
        skn, svn, offs_n, qpos, LK, D, offs_d, (cf, ca, ca_pos), KMASK, (shift, tau, inv), E0, PASS=2, CAUSAL=CAUSAL,
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
    Q, K, V, KMASK, ALPHA, SLOPES, LAMBDA, OUT, ENT_OUT, COUNTS, q_strides, k_strides, v_strides, smb, sizes, scale,
    stop,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    DOT_F32: tl.constexpr, FAST: tl.constexpr, COUNT: tl.constexpr, ENTROPY: tl.constexpr, EXACT_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Entmax / ASEntmax with one key split (prefill): the whole computation in one launch (`_entmax_program`,
    seeded and stepping to its class model's root); without ENTROPY (a caller that does not ask for it) ENT_OUT is
    not written. EXACT_D: D = BLOCK_D (as in the TensorRT form), so no load masks head-dim lanes — a masked load
    under a branch (the output sweep's V) zeroes its registers first. The host picks the pipeline stages
    (`attention.entmax_stages`)."""
    H, GROUP, LQ, LK, D = sizes
    _entmax_program(
        Q, K, V, KMASK, ALPHA, SLOPES, LAMBDA, OUT, ENT_OUT, COUNTS, q_strides, k_strides, v_strides, smb,
        (H, GROUP, LQ, LK, BLOCK_D if EXACT_D else D), scale, stop,
        CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, DOT_F32, FAST, COUNT, not DOT_F32, BLOCK_M, BLOCK_N,
        min(2 * BLOCK_N, 128), BLOCK_D, ENTROPY,
    )  # fmt: skip
