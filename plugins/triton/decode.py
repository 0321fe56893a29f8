"""Split-K decode's entmax kernels (logits, thresholds, outputs) and the merge of per-split softmax states
(split-K and paged decode's last step)."""

from __future__ import annotations

import triton
import triton.language as tl

from sharp.plugins.triton.common import (
    _entropy,
    _load_q,
    _load_v,
    _logits,
    _program,
    _pv,
    _row_params,
)
from sharp.plugins.triton.threshold import (
    GENERAL_SELECTED,
    _bracket,
    _powers,
    _seed,
    _support,
    _threshold_step,
    _weights,
)


@triton.jit
def _entmax_logits_kernel(
    Q, K, ALPHA, SLOPES, LAMBDA, KMASK, U_OUT, q_strides, k_strides, sizes, scale, keys_per_split, smb,
    CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, HAS_KMASK: tl.constexpr,
    DOT_F32: tl.constexpr, PACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Split-K entmax decode, step 1: u = (α−1) z of this split's keys into U (B·Hq, Lq, Lk) fp32 (−inf where
    masked), so the threshold kernel reads 4 bytes per logit instead of recomputing Q·Kᵀ every pass. Strides are
    (batch, head, position, dim); sizes: (H, GROUP, LQ, LK, D); PACKED: a KV head's queries a program (`_program`)."""
    H, GROUP, LQ, LK, D = sizes
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h, hkv, offs_m, qpos, lo, hi = _program(
        pid_bh, pid_m, pid_s, H, GROUP, LQ, LK, keys_per_split, CAUSAL, PACKED, BLOCK_M
    )
    bh = b * H + h if PACKED else pid_bh  # each row's (B·Hq) index where the rows are a KV head's query heads
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    keep = offs_m < LQ
    row = bh * LQ + offs_m
    slope, lam = _row_params(SLOPES, LAMBDA, h, bh, offs_m, LQ, HAS_ALIBI, HAS_LAMBDA)
    am1 = tl.load(ALPHA + h) - 1.0
    if PACKED:  # per row, each row's head's: as columns against a tile
        am1 = am1[:, None]
        slope = slope[:, None] if HAS_ALIBI else slope
    q = _load_q(Q, q_strides, b, h, offs_m, offs_d, LQ, D, DOT_F32, PACKED)
    end = tl.minimum(pid_s * keys_per_split + keys_per_split, LK)
    for start_n in range(lo, end, BLOCK_N):
        cols = start_n + offs_n
        if start_n < hi:
            z = _logits(
                q, K, b, hkv, start_n, offs_n, offs_d, qpos, k_strides, LK, D, scale, slope, lam, KMASK, smb,
                CAUSAL, HAS_ALIBI, HAS_LAMBDA, HAS_KMASK, DOT_F32,
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
    U, V, ALPHA, UMAX, TAU, Z_OUT, PLOGP_OUT, ACC_OUT, SKIPPED_OUT, v_strides, sizes, split,
    CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, FAST: tl.constexpr, PACKED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Split-K entmax decode, step 3: w = [(u − max u) − τ]_+^{1/(α−1)} from the u that step 1 wrote (the τ of step 2
    was found on exactly these values: recomputing Q·Kᵀ here would round u differently — an FMA — and at α > 2 the
    weights near the threshold are that sensitive; it also reads 4 bytes per logit instead of K); partial Σ w,
    Σ w log w, Σ w v per split (summed on the device by the host's tensor ops). Key tiles where every w is 0 skip the
    V load and the second matmul; their count is written per program. sizes: (H, GROUP, LQ, LK, D); split: (BH,
    keys_per_split)."""
    H, GROUP, LQ, LK, D = sizes
    BH, keys_per_split = split
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, h, hkv, offs_m, _, lo, hi = _program(
        pid_bh, pid_m, pid_s, H, GROUP, LQ, LK, keys_per_split, CAUSAL, PACKED, BLOCK_M
    )
    row = (b * H + h if PACKED else pid_bh) * LQ + offs_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    inv = 1.0 / (tl.load(ALPHA + h) - 1.0)
    if PACKED:  # per row: each row's head
        inv = inv[:, None]
    keep = offs_m < LQ
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
            v = _load_v(V, v_strides, b, hkv, start_n, offs_n, offs_d, LK, D, DOT_F32)
            acc += _pv(w, v, DOT_F32)
        else:
            skipped += 1
    out_row = pid_s * (BH * LQ) + row
    tl.store(Z_OUT + out_row, zsum, mask=keep)
    tl.store(PLOGP_OUT + out_row, plogp, mask=keep)
    tl.store(ACC_OUT + out_row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=keep[:, None])
    n_qblocks = tl.cdiv(LQ, BLOCK_M)
    tl.store(SKIPPED_OUT + (pid_s * BH + pid_bh) * n_qblocks + pid_m, skipped)


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
