"""The floor: a minimal FlashAttention-2-style softmax forward in the kernels' own layout, no entropy.

Nothing serves with it. `sharp-bench kernels --static` reports every norm's key loop as a ratio to this kernel's:
exp2 with log2(e) folded into the scale (one FFMA and one MUFU.EX2 per score element), masks only on the tiles
that need them (the causal diagonal and a partial last tile), pointers advanced rather than rebuilt, and P·V
accumulated into the rescaled output by the tensor cores. It is what a softmax kernel costs when it does nothing
else, so a norm's ratio to it is the price of that norm (and of its entropy).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2 e)


@triton.jit
def _floor_tiles(acc, m_i, l_i, q, K, V, k_offs, v_offs, start, end, qpos, skn, svn, LK, qk_scale,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Keys [start, end) in BLOCK_N tiles; MASKED: keys ≥ LK and (CAUSAL) after a row's position read −inf."""
    offs_n = tl.arange(0, BLOCK_N)
    K += start * skn
    V += start * svn
    for start_n in range(start, end, BLOCK_N):
        if MASKED:
            cols = start_n + offs_n
            kt = tl.load(K + k_offs, mask=cols[None, :] < LK, other=0.0)
            v = tl.load(V + v_offs, mask=cols[:, None] < LK, other=0.0)
        else:
            kt = tl.load(K + k_offs)
            v = tl.load(V + v_offs)
        if DOT_F32:
            qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        if MASKED:
            visible = cols[None, :] < LK
            if CAUSAL:
                visible = visible & (cols[None, :] <= qpos[:, None])
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DOT_F32:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        K += BLOCK_N * skn
        V += BLOCK_N * svn
    return acc, m_i, l_i


@triton.jit
def _floor_kernel(
    Q, K, V, OUT, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, H, GROUP, LQ, LK, scale,
    CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Softmax attention of BLOCK_M query rows of one head: grid (⌈Lq/BLOCK_M⌉, B·H). OUT is (B·H, Lq, BLOCK_D);
    the head dim is BLOCK_D (no padding lanes)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    Q += b * sqb + h * sqh
    K += b * skb + (h // GROUP) * skh
    V += b * svb + (h // GROUP) * svh
    q = tl.load(Q + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=offs_m[:, None] < LQ, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_offs = offs_n[None, :] * skn + offs_d[:, None] * skd  # a tile's offsets from its first key
    v_offs = offs_n[:, None] * svn + offs_d[None, :] * svd
    qpos = offs_m + (LK - LQ)
    qk_scale = scale * LOG2E
    hi = LK
    full = LK // BLOCK_N * BLOCK_N  # keys every row sees in whole tiles
    if CAUSAL:
        hi = tl.minimum(LK, tl.minimum(pid_m * BLOCK_M + BLOCK_M, LQ) + (LK - LQ))
        full = tl.minimum(full, tl.maximum(pid_m * BLOCK_M + (LK - LQ) + 1, 0) // BLOCK_N * BLOCK_N)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _floor_tiles(acc, m_i, l_i, q, K, V, k_offs, v_offs, 0, full, qpos, skn, svn, LK, qk_scale,
                                 MASKED=False, CAUSAL=CAUSAL, DOT_F32=DOT_F32, BLOCK_N=BLOCK_N)  # fmt: skip
    acc, m_i, l_i = _floor_tiles(acc, m_i, l_i, q, K, V, k_offs, v_offs, full, hi, qpos, skn, svn, LK, qk_scale,
                                 MASKED=True, CAUSAL=CAUSAL, DOT_F32=DOT_F32, BLOCK_N=BLOCK_N)  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row = pid_bh * LQ + offs_m
    tl.store(OUT + row[:, None] * BLOCK_D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=offs_m[:, None] < LQ)


KERNELS = {"floor": _floor_kernel}
