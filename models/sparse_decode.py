"""Exact sparse entmax decode over a paged KV cache: the pages that provably get zero weight are not read.

α-entmax gives key i the weight [u_i − τ*]_+^{1/(α−1)} with u = (α−1)·z. On any subset S of the keys the threshold
τ_S (the τ that normalises S alone) is ≤ τ*: Σ_{i∈S} [u_i − τ]_+^k grows with S and falls with τ. So a key with
u_i ≤ τ_S has weight exactly zero, and so does every key of a page whose bound on u is ≤ τ_S. The bound comes
from the page's summary — per KV head and dimension the minimum and maximum of its stored keys, kept beside the
pool and updated on every write (`PagedLayer.write`) — as Quest bounds a query's dot product:
q·k ≤ Σ_d max(q_d·kmin_d, q_d·kmax_d), with ALiBi's term bounded at the page's first or last position and the
sign of the logit scale (ASEntmax's λ) choosing the upper or the lower bound. The threshold over the pages read is
then τ* itself (the skipped keys add nothing at τ*), so outputs and entropies are those of dense entmax.

A decode step: bound every page of the sequence (reads 2·D numbers per page and KV head, 1/8 of the keys at 16 keys
a page); read the pages with the highest bounds and take τ_S on them; keep every page whose bound is above τ_S;
if far more are kept than were read, read more of the best pages (a τ_S closer to τ*) and filter again; then the
exact entmax over the kept pages. The math is docs/attention.md's ("Sparse entmax decode").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sharp.models.normalizers import entmax, entmax_threshold, entropy

FIRST_PAGES = 8  # pages read first for τ_S
GROW = 4  # read GROW× more pages for τ_S while more than GROW× the pages read survive and the last growth paid
TAU_HALVINGS = 10  # τ_S as bisection's lower end after 10 halvings: ≤ τ_S, within 1e-3 — a third of the work
NEWTON = 2  # Newton steps that raise the key-level floor of τ* before the exact entmax over the keys above it
SOLVE = 30  # at most this many Newton steps for τ* over the candidates; then entmax's own search
SOLVED = 1e-12  # a Newton step this small (relative to |τ|): τ* to fp64's resolution
MARGIN = 1e-6  # τ_S is lowered by this (relative): a rounding in τ_S can only cost a skip, never a key with weight


def lowered(tau: Tensor) -> Tensor:
    """A lower bound of τ* lowered by MARGIN (relative, at least absolute): a rounding in it can then only keep a
    page or a key more, never drop one with weight."""
    return tau - MARGIN * tau.abs().clamp(min=1.0)


@dataclass(frozen=True)
class SparseStats:
    """What a step did, summed over its (sequence, query head) rows: the pages there were, the pages kept for the
    exact entmax (their keys read), the pages whose keys were read over all passes (a growing τ_S pass reads its
    first pages again), the keys whose values were read (the candidates for the support), and the pages holding a
    key with weight — the fewest any bound on a page's keys could keep, so `kept` against `weighted` tells a loose
    bound from a support spread over many pages. `skipped`: the fraction of pages not kept (their keys and values
    never read). The `by_head` tuples split pages, kept and weighted by query head (summed over sequences)."""

    pages: int
    kept: int
    reads: int
    values: int
    weighted: int
    by_head: tuple[tuple[int, int, int], ...] = ()  # (pages, kept, weighted) of each query head

    @property
    def skipped(self) -> float:
        return 1.0 - self.kept / self.pages if self.pages else 0.0


def page_bounds(
    q: Tensor, bounds: Tensor, table: Tensor, lengths: Tensor, page_size: int, scale: float, lam: Tensor,
    alibi_slopes: Tensor | None,
) -> Tensor:  # fmt: skip
    """Upper bounds on the final logit z = λ·(scale·q·k + slope·(j − i)) of every key of each page, (B, Hq, pages)
    in fp32, −inf for a page past the sequence. q (B, Hq, D); bounds (2, Hkv, pool pages, D) the pages' key minima
    and maxima; table (B, pages) the block table; lengths (B,) keys per sequence (the query sits at length − 1);
    scale > 0; lam (B, Hq) the per-query factor λ (its sign picks the upper or the lower bound)."""
    b, hq, d = q.shape
    hkv = bounds.shape[1]
    qg = q.float().view(b, hkv, hq // hkv, d)
    flat = table.long().flatten()  # whole rows of D numbers: one contiguous copy each
    kmin = bounds[0].index_select(1, flat).view(hkv, *table.shape, d)  # (Hkv, B, pages, D)
    kmax = bounds[1].index_select(1, flat).view(hkv, *table.shape, d)
    pos, neg = qg.clamp(min=0), qg.clamp(max=0)
    flipped = bool((lam < 0).any())  # only a negative λ needs the lower bound
    upper = torch.einsum("bhgd,hbpd->bhgp", pos, kmax) + torch.einsum("bhgd,hbpd->bhgp", neg, kmin)
    upper = upper.reshape(b, hq, -1) * scale
    if flipped:
        lower = torch.einsum("bhgd,hbpd->bhgp", pos, kmin) + torch.einsum("bhgd,hbpd->bhgp", neg, kmax)
        lower = lower.reshape(b, hq, -1) * scale
    first = torch.arange(table.shape[1], device=q.device) * page_size  # (pages,) each page's first position
    if alibi_slopes is not None:
        query = (lengths.long() - 1)[:, None, None]
        at_first = alibi_slopes.float().view(1, -1, 1) * (first.view(1, 1, -1) - query)
        at_last = alibi_slopes.float().view(1, -1, 1) * (first.view(1, 1, -1) + page_size - 1 - query)
        upper = upper + torch.maximum(at_first, at_last)  # linear in j: extreme at the page's ends
        if flipped:
            lower = lower + torch.minimum(at_first, at_last)
    lam = lam[..., None]
    z = torch.where(lam >= 0, lam * upper, lam * lower) if flipped else lam * upper
    return z.masked_fill(first.view(1, 1, -1) >= lengths.view(-1, 1, 1), float("-inf"))


def _logits(
    q: Tensor, keys: Tensor, pages: Tensor, picks: Tensor, lengths: Tensor, scale: float, lam: Tensor,
    alibi_slopes: Tensor | None, heads: Tensor,
) -> Tensor:  # fmt: skip
    """Exact logits of the keys on the picked pages, (B, Hq, picks·page_size), −inf past the sequence or where the
    pick is padding (−1): λ·(scale·q·k + slope·(j − i)), in the order the dense logits are formed. pages (B, Hq,
    picks) physical pages; picks the same pages' indices in the sequence; heads (Hq,) each query head's KV head."""
    hkv, pool, page_size, d = keys.shape
    row, head, pick = (pages >= 0).nonzero(as_tuple=True)  # the real picks: a row's padding reads nothing
    k = keys.reshape(hkv * pool, page_size, d).index_select(0, heads[head] * pool + pages[row, head, pick])
    z = q.new_zeros((*pages.shape, page_size), dtype=torch.float32)  # whole pages, one contiguous copy each
    z[row, head, pick] = torch.bmm(q.float()[row, head, None], k.float().transpose(1, 2))[:, 0] * scale
    token = picks[..., None] * page_size + torch.arange(page_size, device=q.device)  # (B, Hq, picks, page_size)
    if alibi_slopes is not None:
        z = z + alibi_slopes.float().view(1, -1, 1, 1) * (token - (lengths.long() - 1).view(-1, 1, 1, 1))
    z = z * lam[..., None, None]
    hidden = (picks[..., None] < 0) | (token >= lengths.view(-1, 1, 1, 1))
    return z.masked_fill(hidden, float("-inf")).flatten(2)


def sparse_entmax_decode(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    bounds: Tensor,
    block_table: Tensor,
    lengths: Tensor,
    alpha: Tensor,
    *,
    query_scale: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, SparseStats]:
    """Entmax attention of one new query per sequence over its pages, reading only the pages that can carry weight.

    q (B, Hq, D) post-RoPE; keys, values the pools (Hkv, pool pages, page_size, D); bounds (2, Hkv, pool pages, D);
    block_table (B, pages) int; lengths (B,) keys per sequence, the query's own included; alpha (Hq,) > 1 per
    head; query_scale (B, Hq) ASEntmax's λ; scale the factor on q·k (default 1/√D). Returns the output (B, Hq, D)
    in q's dtype, the entropy (B, Hq) in fp32 and what was read."""
    b, hq, d = q.shape
    hkv, _, page_size, _ = keys.shape
    heads = torch.arange(hq, device=q.device) // (hq // hkv)
    scale = d**-0.5 if scale is None else scale
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    lam = torch.ones(b, hq, device=q.device) if query_scale is None else query_scale.float()
    am1 = (alpha.float() - 1.0).view(1, -1, 1)
    if bool((am1 <= 0).any()):
        raise ValueError("sparse entmax decode needs every alpha > 1 (alpha = 1 is softmax: nothing is zero)")
    bound = page_bounds(q, bounds, block_table, lengths, page_size, scale, lam, alibi_slopes) * am1  # on u = (α−1)·z
    valid = (bound > float("-inf")).sum(-1)  # (B, Hq) pages of each sequence
    count = int(valid.max())
    order = bound.topk(count, dim=-1).indices  # pages by bound, best first; padding (−inf) last
    ranked = bound.gather(-1, order)
    read = min(FIRST_PAGES, count)
    reads, before = 0, None

    def logits_of(first: int, last: int, mask: Tensor) -> tuple[Tensor, Tensor]:
        """The pages ranked [first, last) where `mask` holds (−1 elsewhere): their pool pages and keys' logits."""
        picks = order[..., first:last].masked_fill(~mask, -1)
        pages = block_table.long().gather(1, picks.clamp(min=0).flatten(1)).view_as(picks).masked_fill(picks < 0, -1)
        return pages, _logits(q, keys, pages, picks, lengths, scale, lam, alibi_slopes, heads)

    while True:
        pages, z = logits_of(0, read, ranked[..., :read] > float("-inf"))
        tau = entmax_threshold(z, alpha.float().view(1, -1, 1), -1, TAU_HALVINGS)  # (B, Hq, 1) on u, ≤ τ_S
        tau = lowered(tau)
        keep = ranked > tau  # a page whose bound is ≤ τ_S holds no key with weight: a prefix of `order` stays
        kept = keep.sum(-1)
        reads += int((ranked[..., :read] > float("-inf")).sum())
        total = int(kept.sum())
        if read == count or not bool((kept > GROW * read).any()) or (before is not None and total > before / 2):
            break  # nothing more to gain, or the last, larger sample did not halve what is kept
        read, before = min(count, GROW * read), total
    width = int(kept.max())  # the pages read for τ_S keep their logits; those past them are read now
    if width > read:
        more, z_more = logits_of(read, width, keep[..., read:width])
        pages, z = torch.cat((pages, more), -1), torch.cat((z, z_more), -1)
        reads += int(keep[..., read:width].sum())
    mask = keep[..., :width]  # a page read for τ_S whose bound is ≤ τ_S drops out too
    pages = pages[..., :width].masked_fill(~mask, -1)
    z = z[..., : width * page_size].masked_fill(~mask.repeat_interleave(page_size, -1), float("-inf"))
    p, at, weighed = _support_entmax(z, alpha.float().view(1, -1, 1), tau)
    slot = at % page_size  # the candidates' values: their pages' slots, nothing else of the kept pages
    physical = pages.gather(-1, at // page_size).clamp(min=0)
    v = values[heads.view(1, -1, 1), physical, slot]  # (B, Hq, candidates, D)
    out = torch.einsum("bhk,bhkd->bhd", p, v.float())
    holds = (
        torch.zeros(pages.shape, device=p.device).scatter_add_(-1, at // page_size, (p > 0).float()) > 0
    )  # pages with weight
    by_head = torch.stack((valid.sum(0), kept.sum(0), holds.sum((0, 2))), -1).tolist()
    stats = SparseStats(int(valid.sum()), int(kept.sum()), reads, weighed, int(holds.sum()), tuple(map(tuple, by_head)))
    return out.to(q.dtype), entropy(p), stats


def _support_entmax(z: Tensor, alpha: Tensor, tau: Tensor) -> tuple[Tensor, Tensor, int]:
    """Entmax of the rows of z (−inf hidden) computed on the keys that can hold weight. τ* is at least the lower
    bound `tau` (on u = (α−1)·z) and at least max(u) − 1 (the largest key's weight is at most 1), so only the keys
    above both are candidates; Newton steps on the candidates raise that floor, each step's τ kept only where
    S(τ) ≥ 1 shows it is still ≤ τ*; the exact entmax over the keys above the final floor is the row's (the others
    are zero at τ*). Returns their weights and their indices in z, (B, Hq, c) each, c the most of any row (a row's
    extra places hold weight 0), and how many there are (the keys whose values are read)."""
    u = z * (alpha - 1.0)
    floor = u.amax(-1, keepdim=True) - 1.0
    floor = torch.maximum(tau, lowered(floor))
    zc, at, _ = _pack(z, u > floor)
    am1 = alpha.double() - 1.0
    k = 1.0 / am1
    floor = _newton_floor(zc.double() * am1, floor.double(), k)
    above = zc * (alpha - 1.0) > floor.float()
    zc2, at2, count = _pack(zc, above)
    u = zc2.double() * am1
    tau_star = _solve(u, floor, k)
    if tau_star is None:
        return entmax(zc2, alpha, dim=-1), at.gather(-1, at2), count  # entmax's own search
    tau_star = tau_star + SOLVED * tau_star.abs().clamp(min=1.0)  # Newton stops below τ*: a key at τ* weighs 0
    p = (u - tau_star).clamp(min=0.0).pow(k)
    return p.float(), at.gather(-1, at2), count  # the weights at τ*, in closed form (they sum to 1 within 1e-12)


def _solve(u: Tensor, floor: Tensor, k: Tensor) -> Tensor | None:
    """τ* of the rows u (fp64, −inf hidden; every key with weight among them) by Newton's method from `floor` ≤ τ*,
    in a few steps where entmax's bisection takes thirty. For α ≤ 2 (k ≥ 1) S(τ) = Σ [u − τ]_+^k is convex and
    falling, so the steps rise to τ* without passing it (a rounding past it stops there), quadratically near it.
    None for α > 2 (S is not convex there: a step can pass τ*), or where the rows did not settle in SOLVE steps."""
    if bool((k < 1).any()):
        return None
    t = floor
    for _ in range(SOLVE):
        d = (u - t).clamp(min=0.0)
        f = d.pow(k).sum(-1, keepdim=True) - 1.0
        step = f.clamp(min=0.0) / (k * torch.where(d > 0, d.pow(k - 1.0), 0.0).sum(-1, keepdim=True)).clamp(min=1e-300)
        if bool((step <= SOLVED * t.abs().clamp(min=1.0)).all()):
            return t
        t = t + step
    return None


def _pack(z: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, int]:
    """The entries of z where `keep` holds, packed to the left of their rows (−inf after them), their indices in z,
    and how many there are."""
    counts = keep.sum(-1)
    row, head, at = keep.nonzero(as_tuple=True)
    place = keep.cumsum(-1)[row, head, at] - 1
    width = max(int(counts.max()), 1)
    packed = z.new_full((*z.shape[:-1], width), float("-inf")).index_put_((row, head, place), z[row, head, at])
    where = torch.zeros(packed.shape, dtype=torch.long, device=z.device).index_put_((row, head, place), at)
    return packed, where, int(counts.sum())


def _newton_floor(u: Tensor, floor: Tensor, k: Tensor) -> Tensor:
    """A higher lower bound of τ* from `floor` (≤ τ*) by NEWTON steps on S(τ) = Σ [u − τ]_+^k (fp64): a step's τ is
    kept only if S(τ) ≥ 1 there, which places it at or below τ* whatever the step did; lowered by MARGIN."""
    best, t = floor, floor
    for i in range(NEWTON + 1):
        d = (u - t).clamp(min=0.0)
        f = d.pow(k).sum(-1, keepdim=True) - 1.0
        best = torch.where(f >= 0, t, best)
        if i == NEWTON:
            break
        slope = k * torch.where(d > 0, d.pow(k - 1.0), 0.0).sum(-1, keepdim=True)
        t = t + f / slope.clamp(min=1e-300)
    return lowered(best)
