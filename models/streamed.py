"""Streamed (O(n)-memory) attention (docs/attention.md) in PyTorch: the oracle the kernels are written against.

Queries go in chunks of QUERY_CHUNK rows and keys in blocks of `block_size`, so the largest temporary is
one (B, Hq, QUERY_CHUNK, block_size) tile; nothing Lq × Lk is ever built. Forward only (inference): the
training path is the reference implementation, whose backward is exact.

State kept per query row (softmax family, over transformed logits t):
    m   running max of t
    Λ   Σ e^{t−m}
    K'  Σ e^{t−m} (t − m)          entropy H = log Λ − K'/Λ
    acc Σ e^{t−m} v                output acc / Λ
The textbook form K = Σ e^{t−m} t with H = m + log Λ − K/Λ gives the same number, but it subtracts two values
of size |t| (≈1e4 for large logits) and loses the entropy to cancellation. K' carries the max-relative form;
on a new max m' it is rescaled as K' ← e^{m−m'} (K' + Λ (m − m')).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sharp.models.normalizers import adaptive_beta, ssa_logits, transform_visible
from sharp.models.problem import AttentionProblem
from sharp.models.registry import Family, Transform

QUERY_CHUNK = 1024
_NEG_INF = float("-inf")


@dataclass
class StreamStats:
    """What a streamed call did: passes over the keys and the key tiles the entmax output pass skipped."""

    key_passes: int = 0
    threshold_passes: int = 0
    tiles_total: int = 0
    tiles_skipped: int = 0
    per_chunk_threshold_passes: list[int] = field(default_factory=list)
    program_threshold_passes: list[int] = field(default_factory=list)  # the Triton kernels': every program's

    @property
    def block_sparsity(self) -> float:
        return self.tiles_skipped / self.tiles_total if self.tiles_total else 0.0


@dataclass
class _Chunk:
    """One chunk of query rows [start, stop) and the key blocks it can see."""

    problem: AttentionProblem
    start: int
    stop: int
    block_size: int

    def __post_init__(self) -> None:
        self.qpos = self.problem.query_positions(self.start, self.stop)
        last_visible = int(self.qpos[-1]) + 1 if self.problem.causal else self.problem.lk
        self.blocks = [(ks, min(ks + self.block_size, last_visible)) for ks in range(0, last_visible, self.block_size)]

    def tiles(self, skip: Callable[[int], bool] | None = None) -> Iterator[tuple[int, int, int, Tensor]]:
        """Yield (block index, key start, key stop, logits) for each block not skipped."""
        for i, (ks, ke) in enumerate(self.blocks):
            if skip is not None and skip(i):
                continue
            yield i, ks, ke, self.problem.logits(self.start, self.stop, ks, ke)


def merge_softmax_states(
    m: Tensor, lam: Tensor, kp: Tensor, acc: Tensor | None, dim: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Merge online-softmax states stacked along `dim` (key tiles or key splits) into one.

    Each state is (m, Λ, K', acc) over its own keys; with M = max m and w = e^{m − M}: Λ = Σ w Λ,
    K' = Σ w (K' + Λ (m − M)), acc = Σ w acc. States that saw no key (m = −inf, Λ = 0) contribute nothing.
    `acc` has one more trailing dim than the others.
    """
    top = m.amax(dim=dim, keepdim=True)
    top_safe = torch.where(top == _NEG_INF, 0.0, top)
    w = torch.exp(m - top_safe)
    live = lam > 0
    shifted = torch.where(live, kp + lam * torch.where(live, m - top_safe, 0.0), 0.0)
    merged_acc = (w.unsqueeze(-1) * acc).sum(dim) if acc is not None else None
    return top.squeeze(dim), (w * lam).sum(dim), (w * shifted).sum(dim), merged_acc


MAX_THRESHOLD_PASSES = 30  # cap on entmax's threshold refinements (they stop at convergence, 5–9 in practice)


def threshold_tol(dtype: torch.dtype) -> float:
    """Convergence of τ: a step of at most 4 ulp of the compute dtype."""
    return 4 * torch.finfo(dtype).eps


def finish_entmax_state(zsum: Tensor, plogp: Tensor, acc: Tensor) -> tuple[Tensor, Tensor]:
    """Output acc / Σw and entropy log Σw − Σ w log w / Σw from the summed unnormalised weights (zsum and plogp
    shaped acc.shape[:-1]); a row with no weight gets zeros."""
    live = zsum > 0
    safe = torch.where(live, zsum, 1.0)
    return acc / safe.unsqueeze(-1), torch.where(live, torch.log(safe) - plogp / safe, 0.0)


def finish_softmax_state(lam: Tensor, kp: Tensor, acc: Tensor | None) -> tuple[Tensor | None, Tensor]:
    """Output acc / Λ and entropy log Λ − K'/Λ; rows that saw no key give zeros."""
    live = lam > 0
    safe = torch.where(live, lam, 1.0)
    ent = torch.where(live, torch.log(safe) - kp / safe, 0.0)
    return (acc / safe.unsqueeze(-1) if acc is not None else None), ent


def _online_softmax(
    chunk: _Chunk, transform: Callable[[Tensor], Tensor], with_values: bool
) -> tuple[Tensor | None, Tensor]:
    """One pass of online softmax over t = transform(z); returns (output or None, entropy of softmax(t))."""
    p = chunk.problem
    rows = (p.batch, p.heads, chunk.stop - chunk.start)
    m = torch.full(rows, _NEG_INF, dtype=p.dtype, device=p.q.device)
    lam = torch.zeros(rows, dtype=p.dtype, device=p.q.device)
    kp = torch.zeros_like(lam)
    acc = torch.zeros((*rows, p.v.shape[-1]), dtype=p.dtype, device=p.q.device) if with_values else None
    for _, ks, ke, z in chunk.tiles():
        t = transform_visible(z, transform)
        # the tile's own state, then merged into the running one
        tm = t.amax(dim=-1)
        e = torch.exp(t - torch.where(tm == _NEG_INF, 0.0, tm).unsqueeze(-1))
        tl_ = e.sum(dim=-1)
        tkp = torch.where(e > 0, e * (t - tm.unsqueeze(-1)), 0.0).sum(dim=-1)
        tacc = torch.matmul(e, p.values(ks, ke)) if acc is not None else None
        m, lam, kp, acc = merge_softmax_states(
            torch.stack((m, tm)),
            torch.stack((lam, tl_)),
            torch.stack((kp, tkp)),
            torch.stack((acc, tacc)) if acc is not None else None,
        )
    return finish_softmax_state(lam, kp, acc)


def _softmax_family(chunk: _Chunk, stats: StreamStats) -> tuple[Tensor, Tensor]:
    p = chunk.problem
    kind = p.norm.transform
    if kind in (Transform.IDENTITY, Transform.NONE):  # NONE: entmax with α = 1, i.e. softmax
        transform = lambda z: z
    elif kind is Transform.LOG_N_SCALE:
        factor = p.ssmax_s * torch.log(p.visible_keys(chunk.qpos))
        transform = lambda z: factor * z
    elif kind is Transform.SIGNED_LOG:
        n, b = p.ssa_n, p.ssa_b
        transform = lambda z: ssa_logits(z, n, b)
    elif kind is Transform.ENTROPY_BETA:  # pass 1 streams (m, Λ, K') of z for β; pass 2 is online softmax over β·z
        _, h = _online_softmax(chunk, lambda z: z, with_values=False)
        stats.key_passes += 1
        beta = adaptive_beta(h, p.poly).unsqueeze(-1)
        transform = lambda z: beta * z
    else:
        raise ValueError(f"no streamed algorithm for transform {kind}")
    out, ent = _online_softmax(chunk, transform, with_values=True)
    stats.key_passes += 1
    return out, ent


def refine_threshold(
    tau: Tensor, lo: Tensor, hi: Tensor, s: Tensor, s1: Tensor, s2: Tensor, inv: Tensor | float, tol: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One safeguarded root step for S(τ) = Σ [u − τ]_+^{1/(α−1)} = 1, given S and the sums behind S', S''.

    s = Σ d^inv, s1 = Σ d^(inv−1), s2 = Σ_{d>0} d^(inv−2) with d = [u − τ]_+ and inv = 1/(α−1). Halley's step
    where S'' is bounded (α ≤ 1.5), Newton's otherwise; a step that leaves the bracket is replaced by
    bisection. Returns (τ, lo, hi, converged).
    """
    f = s - 1.0
    lo = torch.where(f > 0, tau, lo)
    hi = torch.where(f > 0, hi, tau)
    fp = -inv * s1
    if (isinstance(inv, float) and inv >= 2.0) or (isinstance(inv, Tensor) and bool((inv >= 2.0).all())):
        fpp = inv * (inv - 1.0) * s2
        step = 2.0 * f * fp / (2.0 * fp * fp - f * fpp)
    else:
        step = f / fp
    cand = tau - step
    ok = torch.isfinite(cand) & (cand >= lo) & (cand <= hi)
    # α > 2 (inv < 1): S has infinite slope where a key enters the support, and Newton can cycle between the
    # bracket's ends, each step inside it; a step across more than half the bracket bisects instead.
    ok = ok & ((torch.as_tensor(inv) >= 1.0) | ((cand - tau).abs() <= 0.5 * (hi - lo)))
    new = torch.where(ok, cand, 0.5 * (lo + hi))
    converged = ((new - tau).abs() <= tol) | (f == 0) | ((hi - lo) <= tol)
    return new, lo, hi, converged


def _entmax(chunk: _Chunk, stats: StreamStats, max_passes: int) -> tuple[Tensor, Tensor]:
    """Entmax over blocks: max pass, threshold passes, output pass that skips all-zero key blocks."""
    p = chunk.problem
    am1 = p.alpha - 1.0
    inv = 1.0 / am1
    # Pass 1: row max of u = (α−1) z, and each block's row max so later passes can skip dead blocks.
    block_max: list[Tensor] = []
    umax = None
    for _, _, _, z in chunk.tiles():
        bm = (am1 * z).amax(dim=-1, keepdim=True)
        block_max.append(bm)
        umax = bm if umax is None else torch.maximum(umax, bm)
    stats.key_passes += 1
    all_masked = umax == _NEG_INF
    shift = torch.where(all_masked, 0.0, umax)
    rel_block_max = [bm - shift for bm in block_max]  # in the frame where each row's max u is 0
    # τ (relative to the row max) lies in [−1, −n^{1−α}]; start at −1, where S ≥ 1.
    n = p.visible_keys(chunk.qpos)
    lo = torch.full_like(shift, -1.0)
    hi = (-torch.pow(n, -am1)).expand_as(lo).clone()
    tau = lo.clone()
    passes = 0
    for _ in range(max_passes):
        s = torch.zeros_like(tau)
        s1 = torch.zeros_like(tau)
        s2 = torch.zeros_like(tau)
        for _, _, _, z in chunk.tiles(skip=lambda i, lo=lo: bool((rel_block_max[i] <= lo).all())):
            d = torch.clamp(am1 * z - shift - tau, min=0.0)
            live = d > 0
            dl = torch.where(live, d, 1.0)
            s = s + torch.where(live, dl.pow(inv), 0.0).sum(dim=-1, keepdim=True)
            s1 = s1 + torch.where(live, dl.pow(inv - 1.0), 0.0).sum(dim=-1, keepdim=True)
            s2 = s2 + torch.where(live, dl.pow(inv - 2.0), 0.0).sum(dim=-1, keepdim=True)
        passes += 1
        tau, lo, hi, conv = refine_threshold(tau, lo, hi, s, s1, s2, inv, tol=threshold_tol(p.dtype))
        if bool((conv | all_masked).all()):
            break
    stats.key_passes += passes
    stats.threshold_passes = max(stats.threshold_passes, passes)
    stats.per_chunk_threshold_passes.append(passes)
    # Output pass: p = [u − τ]_+^{1/(α−1)}, normalised; H = log Z − Σ p log p / Z.
    rows = tau.shape
    zsum = torch.zeros(rows, dtype=p.dtype, device=p.q.device)
    plogp = torch.zeros_like(zsum)
    acc = torch.zeros((*rows[:3], p.v.shape[-1]), dtype=p.dtype, device=p.q.device)
    for _, ks, ke, z in chunk.tiles(skip=lambda i: bool((rel_block_max[i] <= tau).all())):
        w = torch.clamp(am1 * z - shift - tau, min=0.0).pow(inv)
        zsum = zsum + w.sum(dim=-1, keepdim=True)
        plogp = plogp + torch.where(w > 0, w * torch.log(torch.where(w > 0, w, 1.0)), 0.0).sum(-1, keepdim=True)
        acc = acc + torch.matmul(w, p.values(ks, ke))
    stats.key_passes += 1
    stats.tiles_total += len(chunk.blocks)
    stats.tiles_skipped += sum(bool((bm <= tau).all()) for bm in rel_block_max)
    return finish_entmax_state(zsum.squeeze(-1), plogp.squeeze(-1), acc)


def streamed_attention(
    problem: AttentionProblem,
    block_size: int = 128,
    stats: StreamStats | None = None,
    max_passes: int = MAX_THRESHOLD_PASSES,
) -> tuple[Tensor, Tensor]:
    """Output (B, Hq, Lq, Dv) in the compute dtype and entropy (B, Hq, Lq), never materialising Lq × Lk."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    stats = stats if stats is not None else StreamStats()
    p = problem
    out = torch.empty(p.batch, p.heads, p.lq, p.v.shape[-1], dtype=p.dtype, device=p.q.device)
    ent = torch.empty(p.batch, p.heads, p.lq, dtype=p.dtype, device=p.q.device)
    family = p.family
    with torch.no_grad():
        for start in range(0, p.lq, QUERY_CHUNK):
            chunk = _Chunk(p, start, min(start + QUERY_CHUNK, p.lq), block_size)
            if family is Family.ENTMAX:
                o, h = _entmax(chunk, stats, max_passes)
            else:
                o, h = _softmax_family(chunk, stats)
            out[:, :, chunk.start : chunk.stop] = o
            ent[:, :, chunk.start : chunk.stop] = h
    return out, ent
