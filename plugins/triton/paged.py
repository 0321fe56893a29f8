"""Paged decode: queries of running sequences against a KV cache kept in fixed-size pages (vLLM-style), for every
norm: the softmax family (softmax, ssmax, SSA, adaptive) and the entmax family (entmax, asentmax).

K and V live in (pages, Hkv, PAGE, D) pools; sequence b's j-th page of keys is pool page `block_table[b, j]`, and
it has `seq_lens[b]` keys (its new tokens included; the last page partly filled). A program owns one sequence, one
KV head and a range of its pages, with the GQA group packed into its rows (group × Lq rows), so each KV page is read
once per KV head, not once per query head. Each program writes a partial state (m, Λ, K', acc); a second kernel
merges the splits on the device and finishes the output and the entropy. Entmax: every page's logits into a
buffer, τ per row refined on chip, then the partial outputs over support tiles only. No host synchronisation: a
decode step built from these launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sharp.models.normalizers import PAPER_POLY, Param, adaptive_beta, entmax_threshold
from sharp.models.registry import ALPHA, SSA_B, SSA_N, SSMAX_S, Family, Transform, get
from sharp.models.sparse_decode import FIRST_PAGES, TAU_HALVINGS, lowered
from sharp.models.streamed import finish_entmax_state
from sharp.plugins.triton.attention import (
    TARGET_PROGRAMS,
    _alpha_fast_path,
    dot_f32,
    find_thresholds,
    head_vector,
    merge_splits,
)
from sharp.plugins.triton.common import _dot, _load_q, _pv
from sharp.plugins.triton.softmax import _online_step, _transform
from sharp.plugins.triton.threshold import _support, _weights


@triton.jit
def _paged_rows(pid_bk, HKV, GROUP, LQ, SEQ, BLOCK_M: tl.constexpr):
    """A paged program's sequence, KV head and rows: the GQA group × Lq queries, each at key position
    seq_len − Lq + i."""
    b = pid_bk // HKV
    hkv = pid_bk % HKV
    rows = tl.arange(0, BLOCK_M)
    h = hkv * GROUP + rows // LQ
    i = rows % LQ
    lk = tl.load(SEQ + b)
    return b, hkv, rows < GROUP * LQ, h, i, lk, i + lk - LQ


@triton.jit
def _page_logits(q, K_PAGES, BT, b, hkv, start, last, sbt, p_strides, offs_n, offs_d, lk, qpos, keep, slope, scale,
                 D, live, HAS_ALIBI: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LIVE: tl.constexpr):  # fmt: skip
    """z of the packed rows against the keys of the pages from `start` (offs_n: the turn's BLOCK_N keys, a whole
    number of pages; pages from `last` on are not read), −inf where masked; each key's offset in the pool; which keys
    are present. p_strides: the pool's (page, head, slot, dim); sbt: the block table's row stride. A turn walks
    several pages so that its fixed work (the block-table lookups, the online rescale) is spread over BLOCK_N keys.
    HAS_LIVE: `live` (BLOCK_N,) says which keys' pages are read at all (sparse entmax decode); the others' keys are
    not loaded and count as absent."""
    spp, sph, spn, spd = p_strides
    page = start + offs_n // PAGE
    cols = start * PAGE + offs_n
    present = (page < last) & (cols < lk)
    if HAS_LIVE:
        present = present & live
    # the turn's pages' entries as one short vector, then each key's: a load per key replicated them (Triton 3.6:
    # 16 requests a thread per turn, 128 B a key; now 32 or 16)
    pages = start + tl.arange(0, BLOCK_N // PAGE)
    slots = tl.load(BT + b * sbt + pages, mask=pages < last, other=0).to(tl.int64)
    slot = tl.reshape(tl.broadcast_to(slots[:, None], [BLOCK_N // PAGE, PAGE]), [BLOCK_N])
    offsets = slot * spp + hkv.to(tl.int64) * sph + (offs_n % PAGE) * spn  # each key's row in the pool
    kt = tl.load(K_PAGES + offsets[None, :] + offs_d[:, None] * spd,
                 mask=present[None, :] & (offs_d[:, None] < D), other=0.0)  # fmt: skip
    z = _dot(q, kt, None, DOT_F32) * scale
    if HAS_ALIBI:
        z += slope[:, None] * (cols[None, :] - qpos[:, None]).to(tl.float32)
    visible = present[None, :] & keep[:, None]
    if CAUSAL:
        visible = visible & (cols[None, :] <= qpos[:, None])
    return tl.where(visible, z, float("-inf")), offsets, present


@triton.jit
def _paged_softmax_kernel(
    Q, K_PAGES, V_PAGES, BT, SEQ, NORM, STATE, q_strides, p_strides, sbt, B, H, GROUP, LQ, HKV, D, scale,
    pages_per_split,
    SSA: tl.constexpr, LOGN: tl.constexpr, HAS_ROWF: tl.constexpr, HAS_ALIBI: tl.constexpr, CAUSAL: tl.constexpr,
    WITH_V: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (B·Hkv, splits). Rows r < GROUP·Lq: query head hkv·GROUP + r // Lq, query r % Lq at key position
    seq_len − Lq + r % Lq. Writes each row's partial state over its split's pages into STATE (M_OUT, L_OUT, KP_OUT,
    ACC_OUT), walking BLOCK_N keys (BLOCK_N / PAGE pages) a turn. NORM: as the softmax family's
    (`_softmax_family_program`; paged decode reads no λ and takes adaptive's β per row, in ROWF)."""
    ROWF, SSMAX_S, SSA_N, SSA_B, SLOPES, _, _, _, _ = NORM
    M_OUT, L_OUT, KP_OUT, ACC_OUT = STATE
    spd = p_strides[3]
    pid_s = tl.program_id(1)
    b, hkv, keep, h, i, lk, qpos = _paged_rows(tl.program_id(0), HKV, GROUP, LQ, SEQ, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_q(Q, q_strides, b, h, tl.where(keep, i, LQ), offs_d, LQ, D, DOT_F32, True)  # rows past GROUP·Lq: none
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h, mask=keep, other=0.0)
    rowf = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    if HAS_ROWF:
        rowf = tl.load(ROWF + (b * H + h) * LQ + i, mask=keep, other=1.0)
    if LOGN:  # every key of the sequence is real (no padding): n = the causal limit, or all keys
        n = (qpos + 1).to(tl.float32) if CAUSAL else tl.zeros([BLOCK_M], dtype=tl.float32) + lk
        rowf = tl.load(SSMAX_S + h, mask=keep, other=1.0) * tl.log(tl.maximum(n, 1.0))
    ssa_n = tl.zeros([BLOCK_M, 1], dtype=tl.float32) + 1.0
    ssa_b = tl.zeros([BLOCK_M, 1], dtype=tl.float32) + 1.0
    if SSA:
        ssa_n = tl.load(SSA_N + h, mask=keep, other=1.0)[:, None]
        ssa_b = tl.load(SSA_B + h, mask=keep, other=1.0)[:, None]
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kp_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first = pid_s * pages_per_split
    last = tl.minimum(first + pages_per_split, tl.cdiv(lk, PAGE))
    for start in range(first, last, BLOCK_N // PAGE):
        z, offsets, present = _page_logits(
            q, K_PAGES, BT, b, hkv, start, last, sbt, p_strides, offs_n, offs_d, lk, qpos, keep, slope, scale, D,
            None, HAS_ALIBI, CAUSAL, DOT_F32, PAGE, BLOCK_N, False,
        )  # fmt: skip
        t = _transform(z, rowf, ssa_n, ssa_b, SSA)
        m_i, l_i, kp_i, r, e = _online_step(m_i, l_i, kp_i, t)
        if WITH_V:
            v = tl.load(V_PAGES + offsets[:, None] + offs_d[None, :] * spd,
                        mask=present[:, None] & (offs_d[None, :] < D), other=0.0)  # fmt: skip
            acc = acc * r[:, None] + _pv(e, v, DOT_F32)
    out_row = ((pid_s * B + b) * H + h) * LQ + i
    tl.store(M_OUT + out_row, m_i, mask=keep)
    tl.store(L_OUT + out_row, l_i, mask=keep)
    tl.store(KP_OUT + out_row, kp_i, mask=keep)
    if WITH_V:
        tl.store(ACC_OUT + out_row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=keep[:, None])


@triton.jit
def _paged_entmax_bounds_kernel(
    Q, BOUNDS, BT, SEQ, ALPHA, SLOPES, LAMBDA, PB_OUT, q_strides, b_strides, sbt, H, GROUP, LQ, HKV, D, scale,
    pages_per_split, max_pages,
    HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Sparse paged entmax, step 0: per row, an upper bound on u = (α−1)·λ·z over every key of each of the split's
    pages into PB (rows × max_pages), from the pages' key summaries BOUNDS (2, Hkv, pool pages, D: per dimension the
    minimum and the maximum; b_strides its four strides). Quest's bound Σ_d max(q_d·kmin_d, q_d·kmax_d) is two
    products, q's positive part with the maxima and its negative part with the minima (fp32, IEEE); where λ < 0 the
    lower bound counts; ALiBi's term, linear in the position, at the page's first or last key. −inf for a page past
    the sequence or, causal, wholly after the row's query."""
    sb0, sbh, sbp, sbd = b_strides
    b, hkv, keep, h, i, lk, qpos = _paged_rows(tl.program_id(0), HKV, GROUP, LQ, SEQ, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_q(Q, q_strides, b, h, tl.where(keep, i, LQ), offs_d, LQ, D, True, True)  # fp32
    pos = tl.maximum(q, 0.0)
    neg = tl.minimum(q, 0.0)
    am1 = tl.load(ALPHA + h, mask=keep, other=2.0) - 1.0
    slope = tl.load(SLOPES + h, mask=keep, other=0.0) if HAS_ALIBI else tl.zeros([BLOCK_M], dtype=tl.float32)
    lam = tl.load(LAMBDA + (b * H + h) * LQ + i, mask=keep, other=1.0) if HAS_LAMBDA else am1 * 0 + 1.0
    row = (b * H + h) * LQ + i
    first = tl.program_id(1) * pages_per_split
    pages_end = tl.cdiv(lk, PAGE)
    for start in range(first, tl.minimum(first + pages_per_split, max_pages), BLOCK_P):
        pages = start + offs_p
        real = (pages < pages_end) & (pages < first + pages_per_split)
        slot = tl.load(BT + b * sbt + pages, mask=real, other=0).to(tl.int64)
        at = hkv.to(tl.int64) * sbh + slot[None, :] * sbp + offs_d[:, None] * sbd  # (BLOCK_D, BLOCK_P)
        inside = real[None, :] & (offs_d[:, None] < D)
        kmin = tl.load(BOUNDS + at, mask=inside, other=0.0)
        kmax = tl.load(BOUNDS + sb0 + at, mask=inside, other=0.0)
        upper = tl.dot(pos, kmax, input_precision="ieee") + tl.dot(neg, kmin, input_precision="ieee")
        upper = upper * scale
        lower = upper
        if HAS_LAMBDA:
            lower = tl.dot(pos, kmin, input_precision="ieee") + tl.dot(neg, kmax, input_precision="ieee")
            lower = lower * scale
        if HAS_ALIBI:
            at_first = slope[:, None] * (pages[None, :] * PAGE - qpos[:, None]).to(tl.float32)
            at_last = slope[:, None] * (pages[None, :] * PAGE + PAGE - 1 - qpos[:, None]).to(tl.float32)
            upper += tl.maximum(at_first, at_last)
            lower += tl.minimum(at_first, at_last)
        z = tl.where(lam[:, None] >= 0, lam[:, None] * upper, lam[:, None] * lower)
        hidden = pages[None, :] >= pages_end
        if CAUSAL:
            hidden = hidden | (pages[None, :] * PAGE > qpos[:, None])
        u = tl.where(hidden, float("-inf"), am1[:, None] * z)
        mask = keep[:, None] & (pages < first + pages_per_split)[None, :] & (pages < max_pages)[None, :]
        tl.store(PB_OUT + row[:, None].to(tl.int64) * max_pages + pages[None, :], u, mask=mask)


@triton.jit
def _paged_entmax_logits_kernel(
    Q, K_PAGES, BT, SEQ, ALPHA, SLOPES, LAMBDA, U_OUT, SPARSE, q_strides, p_strides, sbt, H, GROUP, LQ, HKV, D, scale,
    pages_per_split, WIDTH,
    HAS_ALIBI: tl.constexpr, HAS_LAMBDA: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
    SKIP: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Paged entmax, step 1: u = (α−1)·λ·z of the split's pages into U (B·Hq·Lq rows × WIDTH keys, prefilled −inf),
    BLOCK_N keys a turn. SKIP (sparse decode): SPARSE = (PB, TAU_S, KEPT_OUT) — the pages' bounds on u (rows ×
    WIDTH / PAGE), each row's τ_S ≤ τ* and a count per program; a page is read only where some row of the program
    bounds it above its τ_S (its other keys can weigh nothing), a turn with no such page is not read at all, and
    the program's count of pages read goes to KEPT_OUT."""
    b, hkv, keep, h, i, lk, qpos = _paged_rows(tl.program_id(0), HKV, GROUP, LQ, SEQ, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_q(Q, q_strides, b, h, tl.where(keep, i, LQ), offs_d, LQ, D, DOT_F32, True)  # rows past GROUP·Lq: none
    am1 = tl.load(ALPHA + h, mask=keep, other=2.0) - 1.0
    slope = tl.load(SLOPES + h, mask=keep, other=0.0) if HAS_ALIBI else tl.zeros([BLOCK_M], dtype=tl.float32)
    lam = tl.load(LAMBDA + (b * H + h) * LQ + i, mask=keep, other=1.0) if HAS_LAMBDA else am1 * 0 + 1.0
    row = (b * H + h) * LQ + i
    first = tl.program_id(1) * pages_per_split
    last = tl.minimum(first + pages_per_split, tl.cdiv(lk, PAGE))
    kept = tl.full([], 0, tl.int32)
    if SKIP:
        PB, TAU_S, KEPT_OUT = SPARSE
        tau_s = tl.load(TAU_S + row, mask=keep, other=float("inf"))
    for start in range(first, last, BLOCK_N // PAGE):
        live = None
        read = True
        if SKIP:
            pages = start + tl.arange(0, BLOCK_N // PAGE)
            bound = tl.load(PB + row[:, None].to(tl.int64) * (WIDTH // PAGE) + pages[None, :],
                            mask=keep[:, None] & (pages < last)[None, :], other=float("-inf"))  # fmt: skip
            live_page = tl.max((bound > tau_s[:, None]).to(tl.int32), 0)  # (pages,): some row may weigh a key
            kept += tl.sum(live_page, 0)
            live = tl.reshape(tl.broadcast_to(live_page[:, None], [BLOCK_N // PAGE, PAGE]), [BLOCK_N]) > 0
            read = tl.max(live_page, 0) > 0
        if read:
            z, _, _ = _page_logits(
                q, K_PAGES, BT, b, hkv, start, last, sbt, p_strides, offs_n, offs_d, lk, qpos, keep, slope, scale, D,
                live, HAS_ALIBI, CAUSAL, DOT_F32, PAGE, BLOCK_N, SKIP,
            )  # fmt: skip
            if HAS_LAMBDA:  # λ of either sign: a masked key's −inf must stay −inf
                u = tl.where(z > float("-inf"), (am1 * lam)[:, None] * z, float("-inf"))
            else:
                u = am1[:, None] * z  # α − 1 > 0
            cols = start * PAGE + offs_n
            mask = keep[:, None] & (start + offs_n // PAGE < last)[None, :]  # the split's pages only
            tl.store(U_OUT + row[:, None].to(tl.int64) * WIDTH + cols[None, :], u, mask=mask)
    if SKIP:
        tl.store(KEPT_OUT + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), kept)


@triton.jit
def _paged_entmax_output_kernel(
    U, V_PAGES, BT, SEQ, ALPHA, UMAX, TAU, Z_OUT, PLOGP_OUT, ACC_OUT, p_strides, sbt, B, H, GROUP, LQ, HKV, D,
    pages_per_split, WIDTH,
    FAST: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Paged entmax, step 3: w = [u − max u − τ]_+^{1/(α−1)} from the logit buffer; partial Σw, Σw log w, Σw·v of
    the split's pages (the V load and P·V skipped where no w > 0)."""
    spp, sph, spn, spd = p_strides
    b, hkv, keep, h, i, lk, _ = _paged_rows(tl.program_id(0), HKV, GROUP, LQ, SEQ, BLOCK_M)
    pid_s = tl.program_id(1)
    offs_n = tl.arange(0, PAGE)
    offs_d = tl.arange(0, BLOCK_D)
    inv = 1.0 / (tl.load(ALPHA + h, mask=keep, other=2.0) - 1.0)
    row = (b * H + h) * LQ + i
    umax = tl.load(UMAX + row, mask=keep, other=0.0)  # (u − max u) − τ: the sum would round τ to max u's ulp
    tau = tl.load(TAU + row, mask=keep, other=0.0)
    zsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    plogp = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first = pid_s * pages_per_split
    for page in range(first, tl.minimum(first + pages_per_split, tl.cdiv(lk, PAGE))):
        cols = page * PAGE + offs_n
        u = tl.load(U + row[:, None].to(tl.int64) * WIDTH + cols[None, :], mask=keep[:, None], other=-float("inf"))
        d = _support(u - umax[:, None], tau[:, None])
        if tl.max(tl.max(d, 1), 0) > 0:
            w, logw = _weights(d, inv[:, None], FAST)
            zsum += tl.sum(w, 1)
            plogp += tl.sum(w * logw, 1)
            base = tl.load(BT + b * sbt + page).to(tl.int64) * spp + hkv.to(tl.int64) * sph
            v = tl.load(V_PAGES + base + offs_n[:, None] * spn + offs_d[None, :] * spd,
                        mask=(cols[:, None] < lk) & (offs_d[None, :] < D), other=0.0)  # fmt: skip
            acc += _pv(w, v, DOT_F32)
    out_row = pid_s * (B * H * LQ) + row
    tl.store(Z_OUT + out_row, zsum, mask=keep)
    tl.store(PLOGP_OUT + out_row, plogp, mask=keep)
    tl.store(ACC_OUT + out_row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=keep[:, None])


# Keys a paged program walks a turn (whole pages): one 16-key page a turn spread the turn's fixed work — the
# block-table lookups, the online rescale, the small products — over 16 keys (`sharp-bench kernels --static`: 137
# instructions per element for softmax where split-K's 64-key tiles take 35).
PAGED_KEYS = 64
# Pages a sparse decode's bound kernel bounds a turn: the summaries' products are (rows × D) · (D × pages) dots.
BOUND_PAGES = 16

# The paged kernels by name, as kernels.KERNELS (the AOT compile check reads both).
KERNELS = {
    "paged_softmax": _paged_softmax_kernel,
    "paged_entmax_bounds": _paged_entmax_bounds_kernel,
    "paged_entmax_logits": _paged_entmax_logits_kernel,
    "paged_entmax_output": _paged_entmax_output_kernel,
}


def paged_decode(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    norm: str,
    causal: bool = True,
    scale: float | None = None,
    alibi_slopes: Tensor | None = None,
    ssa_n: Param = SSA_N.default,
    ssa_b: Param = SSA_B.default,
    ssmax_s: Param = SSMAX_S.default,
    alpha: Param = ALPHA.default,
    query_scale: Tensor | None = None,
    poly: tuple[float, ...] | Tensor = PAPER_POLY,
    splits: int | None = None,
    page_bounds: Tensor | None = None,
    pages_read: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of q (B, Hq, Lq, D) — each sequence's newest Lq tokens — over its paged keys: output (B, Hq, Lq, D)
    in q's dtype and entropy (B, Hq, Lq) fp32. Parameters and their defaults are `attend`'s (the registry's): floats
    or per-head (Hq,) tensors; `query_scale` (B, Hq, Lq) for the entmax family.

    `page_bounds` (2, Hkv, pool pages, D), the pages' per-dimension key minima and maxima, makes the entmax family's
    decode sparse and still exact: the pages that provably get zero weight are not read (`_sparse_threshold`);
    `pages_read` (B, Hkv) int32, if given, receives the pages each sequence's KV head read."""
    spec = get(norm)
    b, hq, lq, d = q.shape
    _, hkv, page, dk = k_pages.shape
    if dk != d or v_pages.shape != k_pages.shape or hq % hkv:
        raise ValueError(f"shapes: q {tuple(q.shape)}, k/v pages {tuple(k_pages.shape)}/{tuple(v_pages.shape)}")
    if page < 16 or page & (page - 1):
        raise ValueError(f"the page size must be a power of two >= 16, got {page}")
    group = hq // hkv
    block_m = max(16, triton.next_power_of_2(group * lq))
    block_d = max(16, triton.next_power_of_2(d))
    dev = q.device
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    max_pages = block_table.shape[1]
    if splits is None:
        splits = max(1, min(max_pages, -(-TARGET_PROGRAMS // (b * hkv))))
    pages_per_split = -(-max_pages // splits)
    splits = -(-max_pages // pages_per_split)
    rows = b * hq * lq
    transform = spec.transform

    def per_head(value: Param | None, used: bool = True) -> Tensor:
        return head_vector(value, hq, dev) if used and value is not None else dummy

    def launch(rowf: Tensor | None, with_v: bool) -> tuple[Tensor, Tensor]:
        m = torch.empty(splits, rows, dtype=torch.float32, device=dev)
        lam, kp = torch.empty_like(m), torch.empty_like(m)
        acc = torch.empty(splits, rows, block_d, dtype=torch.float32, device=dev) if with_v else dummy
        norm_params = (
            rowf if rowf is not None else dummy,
            per_head(ssmax_s, transform is Transform.LOG_N_SCALE),
            per_head(ssa_n, transform is Transform.SIGNED_LOG),
            per_head(ssa_b, transform is Transform.SIGNED_LOG),
            per_head(alibi_slopes),
            dummy,  # λ: not read
            dummy,
            0,
            0.0,  # adaptive's polynomial: not read (β comes per row, in ROWF)
        )
        _paged_softmax_kernel[(b * hkv, splits)](
            q, k_pages, v_pages, block_table, seq_lens, norm_params, (m, lam, kp, acc), q.stride(), k_pages.stride(),
            block_table.stride(0), b, hq, group, lq, hkv, d, scale if scale is not None else d**-0.5, pages_per_split,
            SSA=transform is Transform.SIGNED_LOG, LOGN=transform is Transform.LOG_N_SCALE, HAS_ROWF=rowf is not None,
            HAS_ALIBI=alibi_slopes is not None, CAUSAL=causal, WITH_V=with_v,
            DOT_F32=dot_f32(q), BLOCK_M=block_m, PAGE=page, BLOCK_N=max(page, PAGED_KEYS), BLOCK_D=block_d,
        )  # fmt: skip
        out = torch.empty(rows, block_d, dtype=q.dtype, device=dev) if with_v else dummy
        ent = torch.empty(rows, dtype=torch.float32, device=dev)
        merge_splits(m, lam, kp, acc, out, ent, block_d, with_v)
        return out, ent

    if spec.family is Family.ENTMAX:
        common = (b, hq, lq, hkv, d, pages_per_split, max_pages * page)
        return _paged_entmax(q, k_pages, v_pages, block_table, seq_lens, alpha, alibi_slopes, query_scale, scale,
                             causal, splits, block_m, block_d, common, page_bounds, pages_read)  # fmt: skip
    if page_bounds is not None:
        raise ValueError(f"page bounds skip pages of the entmax family only, not {norm}")
    rowf = None
    if transform is Transform.ENTROPY_BETA:  # β from each row's softmax entropy: a statistics pass first
        _, h = launch(None, with_v=False)
        rowf = adaptive_beta(h, poly).float().contiguous()
    elif transform not in (Transform.IDENTITY, Transform.NONE, Transform.LOG_N_SCALE, Transform.SIGNED_LOG):
        raise ValueError(f"no paged kernel for transform {transform}")
    out, ent = launch(rowf, with_v=True)
    return out[:, :d].reshape(b, hq, lq, d), ent.reshape(b, hq, lq)


def _paged_entmax(q, k_pages, v_pages, block_table, seq_lens, alpha, alibi_slopes, query_scale, scale, causal, splits,
                  block_m, block_d, common, page_bounds, pages_read) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Logits of every page into a −inf-filled buffer, τ per row on chip (the split-K threshold kernel), then the
    partial outputs per split and device-side sums — three launches, no host synchronisation. With page bounds,
    first each page's bound and each row's τ_S (`_sparse_threshold`), and the logits of the pages above it only:
    a skipped key has u ≤ τ_S ≤ τ*, weight 0, so τ over the keys read is τ* and the output is dense entmax's."""
    b, hq, lq, hkv, d, pages_per_split, width = common
    dev, page = q.device, k_pages.shape[2]
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    alpha_h = head_vector(alpha, hq, dev)
    rows = b * hq * lq
    u = torch.full((rows, width), float("-inf"), dtype=torch.float32, device=dev)
    upcast = dot_f32(q)
    grid = (b * hkv, splits)
    scale = scale if scale is not None else d**-0.5
    slopes = alibi_slopes.float().contiguous() if alibi_slopes is not None else dummy
    lam = query_scale.float().contiguous() if query_scale is not None else dummy
    sparse = (dummy, dummy, torch.empty(1, dtype=torch.int32, device=dev))  # not read without SKIP
    if page_bounds is not None:
        if page_bounds.shape != (2, hkv, k_pages.shape[0], d):
            raise ValueError(f"page bounds must be (2, {hkv}, {k_pages.shape[0]}, {d}), got {tuple(page_bounds.shape)}")
        if not scale > 0:
            raise ValueError(f"sparse entmax decode needs a scale > 0, got {scale}")
        pb = torch.empty(rows, width // page, dtype=torch.float32, device=dev)
        _paged_entmax_bounds_kernel[grid](
            q, page_bounds, block_table, seq_lens, alpha_h, slopes, lam, pb, q.stride(), page_bounds.stride(),
            block_table.stride(0), hq, hq // hkv, lq, hkv, d, scale, pages_per_split, width // page,
            HAS_ALIBI=alibi_slopes is not None, HAS_LAMBDA=query_scale is not None, CAUSAL=causal, BLOCK_M=block_m,
            PAGE=page, BLOCK_P=BOUND_PAGES, BLOCK_D=block_d,
        )  # fmt: skip
        tau_s = _sparse_threshold(q, k_pages, block_table, seq_lens, pb, alpha_h, slopes if alibi_slopes is not None
                                  else None, query_scale, scale, causal)  # fmt: skip
        sparse = (pb, tau_s, torch.empty(b * hkv, splits, dtype=torch.int32, device=dev))
    _paged_entmax_logits_kernel[grid](
        q, k_pages, block_table, seq_lens, alpha_h, slopes, lam, u, sparse, q.stride(), k_pages.stride(),
        block_table.stride(0),
        hq, hq // hkv, lq, hkv, d, scale, pages_per_split, width,
        HAS_ALIBI=alibi_slopes is not None, HAS_LAMBDA=query_scale is not None, CAUSAL=causal, DOT_F32=upcast,
        SKIP=page_bounds is not None, BLOCK_M=block_m, PAGE=page, BLOCK_N=max(page, PAGED_KEYS), BLOCK_D=block_d,
    )  # fmt: skip
    if page_bounds is not None and pages_read is not None:
        pages_read.copy_(sparse[2].sum(1).view(b, hkv))
    umax = torch.empty(rows, dtype=torch.float32, device=dev)
    tau = torch.empty_like(umax)
    fast = _alpha_fast_path(alpha)
    find_thresholds(u, alpha_h, umax, tau, dummy, hq, lq, width, rows, fast, False)
    zsum = torch.empty(splits, rows, dtype=torch.float32, device=dev)
    plogp = torch.empty_like(zsum)
    acc = torch.empty(splits, rows, block_d, dtype=torch.float32, device=dev)
    _paged_entmax_output_kernel[grid](
        u, v_pages, block_table, seq_lens, alpha_h, umax, tau, zsum, plogp, acc,
        v_pages.stride(), block_table.stride(0), b, hq, hq // hkv, lq, hkv, d, pages_per_split, width,
        FAST=fast, DOT_F32=upcast, BLOCK_M=block_m, PAGE=page, BLOCK_D=block_d,
    )  # fmt: skip
    out, ent = finish_entmax_state(zsum.sum(0), plogp.sum(0), acc.sum(0)[:, :d])
    return out.to(q.dtype).reshape(b, hq, lq, d), ent.reshape(b, hq, lq)


def _sparse_threshold(q, k_pages, block_table, seq_lens, pb, alpha, slopes, query_scale, scale, causal) -> Tensor:
    """Each row's τ_S ≤ τ*: the entmax threshold over the keys of its FIRST_PAGES pages with the highest bounds
    (bisection's lower end, lowered by MARGIN so a rounding can cost a skip but never a key with weight), on the
    device without a host synchronisation. The pages' exact logits are formed as the logits kernel forms them."""
    b, hq, lq, d = q.shape
    hkv, page = k_pages.shape[1], k_pages.shape[2]
    rows = b * hq * lq
    top = pb.topk(min(FIRST_PAGES, pb.shape[1]), dim=-1)  # (rows, f)
    r = torch.arange(rows, device=q.device)
    seq, head, i = r // (hq * lq), (r // lq) % hq, r % lq
    physical = block_table.long()[seq[:, None], top.indices]  # (rows, f)
    k = k_pages[physical, (head // (hq // hkv))[:, None]].float()  # (rows, f, page, D)
    z = torch.einsum("rd,rfpd->rfp", q.reshape(rows, d).float(), k) * scale
    cols = top.indices[..., None] * page + torch.arange(page, device=q.device)
    qpos = (seq_lens.long()[seq] - lq + i)[:, None, None]
    if slopes is not None:
        z = z + slopes[head][:, None, None] * (cols - qpos).float()
    if query_scale is not None:
        z = z * query_scale.float().reshape(rows)[:, None, None]
    hidden = (cols >= seq_lens.long()[seq][:, None, None]) | (top.values == float("-inf"))[..., None]
    if causal:
        hidden = hidden | (cols > qpos)
    z = z.masked_fill(hidden, float("-inf")).flatten(1)
    tau = entmax_threshold(z, alpha[head][:, None], -1, TAU_HALVINGS)[:, 0]
    return lowered(tau).contiguous()
