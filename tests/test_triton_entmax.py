"""The Triton kernels' entmax threshold search (plugins/triton/threshold.py, entmax.py), in the interpreter on CPU:
α fast paths and per-head α, pass counts, the safeguarded steps at large α, the seed and class model that settle the
root in few passes, sparsemax's exact step, output passes that skip tiles without weight."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


import triton
import triton.language as tl
from devices import ATOL, DEVICE
from triton_cases import host, problem, qkv

from sharp.models import attend
from sharp.models.streamed import StreamStats
from sharp.plugins.triton.attention import launch_config, run_problem
from sharp.plugins.triton.common import PARTIALS, _fold_sum, _shift_columns, _shift_rows
from sharp.plugins.triton.threshold import (
    GENERAL_SELECTED,
    _bracket,
    _class_partials,
    _class_root,
    _powers,
    _seed,
    _support,
    _threshold_step,
)

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy warnings inside the interpreter
]


@triton.jit
def _shift_probe(S, COLS, ROWS, DT: tl.constexpr):
    """The shift columns of 16 row maxima and the key side's first 16 columns (transposed), as fp32."""
    r = tl.arange(0, 16)
    c = tl.arange(0, PARTIALS)
    tl.store(COLS + r[:, None] * PARTIALS + c[None, :], _shift_columns(tl.load(S + r), DT).to(tl.float32))
    tl.store(ROWS + r[:, None] * PARTIALS + c[None, :], tl.trans(_shift_rows(16, DT)).to(tl.float32))


@triton.jit
def _seed_probe(X, INV, TAU, ROWS: tl.constexpr):
    """The threshold search's seed for ROWS rows of PARTIALS class maxima."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, PARTIALS)
    tl.store(TAU + r, _seed(tl.load(X + r[:, None] * PARTIALS + c[None, :]), tl.load(INV)))


@triton.jit
def _class_probe(X, XC, INV, TAU, OUT, EXACT, LK, tol, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The class model's root (`_class_root`) for ROWS rows of LK values x = u − max u and their PARTIALS class
    maxima XC, from one threshold pass's sums at TAU kept per class (selected powers, as the decode kernel forms
    them; the bracket that pass leaves, [TAU, 0] or [−1, TAU]), and whether it is exact."""
    rows = tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_N)
    inv = tl.load(INV + rows)
    tau = tl.load(TAU + rows)
    zero = tl.zeros([ROWS], dtype=tl.float32)
    a0 = tl.zeros([ROWS, PARTIALS], dtype=tl.float32)
    a1, a2 = a0, a0
    for start in range(0, LK, BLOCK_N):
        d = _support(tl.load(X + rows[:, None] * LK + start + offs[None, :]), tau[:, None])
        p0, p1, p2 = _powers(d, inv[:, None], GENERAL_SELECTED)
        a0, a1, a2 = _fold_sum(a0, p0), _fold_sum(a1, p1), _fold_sum(a2, p2)
    c0, c1, counts, counted = _class_partials(a0, a1, a2, inv, 0)  # (GENERAL_SELECTED: at α > 2 the third sum counts)
    s0 = tl.sum(c0, 1)
    xc = tl.load(XC + rows[:, None] * PARTIALS + tl.arange(0, PARTIALS)[None, :])
    above = s0 > 1.0
    lo, hi = tl.where(above, tau, zero - 1.0), tl.where(above, zero, tau)
    root, _, exact = _class_root(xc, tau, lo, hi, c0, c1, counts, counted, s0, inv, tol, rows < 0)
    tl.store(OUT + rows, root)
    tl.store(EXACT + rows, exact.to(tl.int32))


@triton.jit
def _search_probe(X, ALPHA, TAU, COUNT, LK, max_passes, tol, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The threshold search's own steps (`_threshold_step` without a seed or class model) from the bracket's low end
    on ROWS rows of LK values x = u − max u (one α per row, Newton's or Halley's: the powers selected): τ per row and
    the passes."""
    rows = tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_N)
    am1 = tl.load(ALPHA + rows) - 1.0
    inv = 1.0 / am1
    zero = tl.zeros([ROWS], dtype=tl.float32)
    _, tau, hi, dead = _bracket(zero, zero + LK, am1, rows >= 0)
    lo, ptau, pfp, passes, todo = tau, tau, zero, 0, True
    while todo:
        a0, a1, a2 = zero, zero, zero
        for start in range(0, LK, BLOCK_N):
            d = _support(tl.load(X + rows[:, None] * LK + start + offs[None, :]), tau[:, None])
            p0, p1, p2 = _powers(d, inv[:, None], GENERAL_SELECTED)
            a0, a1, a2 = a0 + tl.sum(p0, 1), a1 + tl.sum(p1, 1), a2 + tl.sum(p2, 1)
        tau, lo, hi, ptau, pfp, passes, todo = _threshold_step(
            tau, lo, hi, ptau, pfp, a0, a1, a2, inv, tol, dead, passes, max_passes, 0.0, 0, False
        )
    tl.store(TAU + rows, tau)
    tl.store(COUNT, passes)


_TL_TYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.3])
@pytest.mark.parametrize("splits", [None, 3])
def test_entmax_scalar_alpha_fast_paths(alpha, splits):
    """α = 1.5 and 2 take the kernels' exp/log-free power paths (α = 1.3 the general one), fused prefill and
    split-K decode (logits → τ on chip → partial outputs)."""
    lq = 21 if splits is None else 3
    q, k, v, _ = qkv(hq=4, hkv=2, lq=lq, lk=75, seed=5)
    kw = dict(norm="entmax", causal=True, alpha=alpha, alibi_slopes=torch.tensor([0.5, 0.25, 0.0, 0.1], device=DEVICE))
    o_ref, h_ref = attend(q, k, v, return_entropy=True, **kw)
    stats = StreamStats()
    o, h = run_problem(problem(q, k, v, **kw), block_size=16, splits=splits, stats=stats)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=0)
    # Halley's step where S'' is bounded (α ≤ 1.5) converges in fewer passes than Newton's (8–9 at these sizes)
    assert 1 <= stats.threshold_passes <= (6 if alpha <= 1.5 else 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", ["entmax", "asentmax"])
def test_per_head_alpha_takes_each_heads_threshold_sweep(norm, dtype, monkeypatch):
    """Per-head α of 1.25, 1.5, 1.75 and 3: the general path's power b = d^e has e > 0, 0, > 0 and < 0. A program
    whose e > 0 sums b with no floor and no select (b = 2^(e·log2 0) = 0 exactly); the others take the selecting sweep
    (e = 0 or e < 0 there would make b 1 or ∞ at d = 0: NaN or wrong sums). Prefill with one key split, causal, a
    padding mask, in fp32 and in half precision (the (rows, 16) column partials), against the float64 reference on
    the same inputs; without the entropy (ENTROPY=False) the same output to the bit (at α = 3 the fp32 reference is
    the one 1.7e-5 off it, the kernel 4.6e-6: k = 1/2 makes the weights' error d^(k−1) times τ's)."""
    monkeypatch.setattr(host, "dot_f32", lambda t: t.dtype == torch.float32)
    q, k, v, qs = qkv(b=2, hq=4, hkv=2, lq=70, lk=70, d=16, seed=5)
    mask = torch.ones(2, 70, dtype=torch.bool, device=DEVICE)
    mask[1, :9] = False
    alpha = torch.tensor([1.25, 1.5, 1.75, 3.0], dtype=torch.float64, device=DEVICE)
    q, k, v = (t.to(dtype) for t in (q * 3.0, k, v))
    kw = dict(norm=norm, causal=True, key_mask=mask, return_entropy=True)
    o_ref, h_ref = attend(q.double(), k.double(), v.double(), alpha=alpha,
                          query_scale=qs.double() if norm == "asentmax" else None, **kw)  # fmt: skip
    kw = dict(kw, alpha=alpha.float(), query_scale=qs if norm == "asentmax" else None)
    kw.pop("return_entropy")
    out, ent = run_problem(problem(q, k, v, **kw), block_size=16)
    o_ref, h_ref = o_ref.float(), h_ref.float()
    out2, ent2 = run_problem(problem(q, k, v, **kw), block_size=16, entropy=False)  # ENTROPY=False: no log w
    assert ent2 is None and torch.equal(out2, out)
    assert torch.isfinite(out.float()).all() and torch.isfinite(ent).all()
    tol, tol_h = (ATOL, ATOL) if dtype == torch.float32 else (2.5e-3, 5e-4)  # fp16: the half rounding of P
    torch.testing.assert_close(out.float(), o_ref, atol=tol, rtol=0)
    torch.testing.assert_close(ent, h_ref, atol=tol_h, rtol=0)


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_entmax_pass_count_and_block_skipping(alpha):
    q, k, v, _ = qkv(hq=2, hkv=2, lq=48, lk=128, seed=3)
    slopes = torch.tensor([2.0, 1.0], device=DEVICE)
    p = problem(q, k, v, norm="entmax", causal=True, alpha=alpha, alibi_slopes=slopes)
    stats = StreamStats()
    out, ent = run_problem(p, block_size=16, stats=stats)
    o_ref, h_ref = attend(q, k, v, norm="entmax", causal=True, alpha=alpha, alibi_slopes=slopes, return_entropy=True)
    torch.testing.assert_close(out, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, h_ref, atol=ATOL, rtol=0)
    assert stats.threshold_passes <= 8
    assert stats.block_sparsity > 0.3


@pytest.mark.parametrize("seed", [3, 28, 45, 49, 53, 236])
def test_entmax_at_large_alpha_converges_through_the_safeguard(seed):
    """α = 2.5 (S concave): the host's threshold steps need the bracket each pass narrows (see test_attention).
    Against the float64 oracle: at α > 2 the threshold is ill-conditioned in fp32, so the inputs sit on a grid
    where every score is exact (the kernels and the streamed reference then measure ≤ 6e-6 here). The seeds were
    chosen (on unrounded inputs) for rows where Newton's steps cycled between the bracket's ends, each inside it
    (output 0.3 off in fp32, first seen on an H100): a step across more than half the bracket must bisect, in the
    streamed reference and the kernel alike (on this grid, the kernel without it fails seeds 53 and 236).
    Seed 49: d = (u − max u) − τ, as the reference forms it; u − (max u + τ) rounds τ to the ulp of max u (1.5e-4
    off in the interpreter, up to 5.9e-3 at α = 3 on the H100)."""
    g = torch.Generator().manual_seed(seed)
    # on a grid of 1/64: every q·k is exact in fp32 whatever the order of its sum, so the outputs do not depend on
    # the BLAS that the interpreter's tl.dot runs on (at this conditioning its rounding alone moved seed 53 by 5e-5)
    q, k, v = ((torch.randn(1, 2, 40, 16, generator=g) * 128).round().to(DEVICE) / 64 for _ in range(3))
    kw = dict(norm="entmax", causal=True, alpha=2.5, return_entropy=True)
    o_ref, h_ref = attend(q.double(), k.double(), v.double(), **kw)
    split_k = run_problem(problem(q, k, v, norm="entmax", causal=True, alpha=2.5), block_size=16, splits=3)
    runs = {impl: attend(q, k, v, impl=impl, block_size=16, **kw) for impl in ("streamed", "triton")}
    for impl, (o, h) in (runs | {"triton split-K": split_k}).items():
        torch.testing.assert_close(o.double(), o_ref, atol=5e-5, rtol=0, msg=lambda m, impl=impl: f"{impl}: {m}")
        torch.testing.assert_close(h.double(), h_ref, atol=5e-5, rtol=0, msg=lambda m, impl=impl: f"{impl}: {m}")


@pytest.mark.parametrize("alpha", [1.25, 1.5, 1.75, 2.0, 2.5])
def test_threshold_search_settles_in_few_passes(alpha):
    """The search starts at the root of the row's class maxima (`_seed`: at or below the row's root, and near it);
    far from the root it steps on S^(1/k) (near-linear in τ), near it on S − 1 with Halley's step, and a step small
    enough that its cubed error is below the tolerance needs no pass to confirm it. Newton's rows (α = 1.75 and 2: S''
    is not summed) step to the root of their class model (`_class_root`, from the pass's sums per key class), and
    near the root the curvature from the previous pass's S' bounds that step's error; at α = 2 a step shorter than the
    distance to the nearest key lands on the root; at α > 2 (S concave between keys) the class model's root is
    bisected per row, and where the pass's count shows each class hiding at most one key in the support it is the
    row's own. At most two threshold passes at α = 1.25 and 2, three at 1.5, 1.75 and 2.5 here (four at 2.5 with one
    hidden key per row; three at 2, four at 1.75 and eight at 2.5 without the class model; 3, 4 and 5 unseeded at
    1.25, 1.5, 1.75; 3 at α = 1.25 without the settling rule or without the steps on S^(1/k)), the float64
    reference's output all the same (at α = 3 on these unrounded inputs the fp32 reference itself is 2.7e-5 off it:
    the large-α test puts its inputs on a grid). (The fitted exponent and the secant are held by the decode
    threshold kernel's test, whose search starts at the bracket's end.)"""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 256, 32, generator=g).to(DEVICE) for _ in range(3))
    p = problem(q, k, v, norm="entmax", causal=True, alpha=alpha)
    stats = StreamStats()
    out, _ = run_problem(p, block_size=64, stats=stats)
    ref = attend(q.double(), k.double(), v.double(), norm="entmax", causal=True, alpha=alpha)  # α > 2: fp32's is off
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)
    assert stats.threshold_passes <= {1.25: 2, 1.5: 3, 1.75: 3, 2.0: 2, 2.5: 3}[alpha]
    cfg = launch_config(p, block_size=64)  # every program's count is kept (sharp-bench kernels --static's mean)
    assert len(stats.program_threshold_passes) == 2 * -(-256 // cfg.block_m)
    assert max(stats.program_threshold_passes) == stats.threshold_passes


def test_halley_rows_step_to_the_class_model_where_the_count_shows_it_exact():
    """α = 1.5 (FAST = 2): the threshold sweep's third sum is Σ d^0, the count of keys in the support, kept per key
    class; where every class hides at most one key in it and S ≥ 1 at τ, the class model's root is the row's and
    Halley's rows take it without a pass to confirm it (elsewhere they keep Halley's step). Sharp rows (logits of
    σ = 4, causal, 256 tokens): 43 threshold passes over the 32 programs where Halley's steps alone took 64, counted
    in the interpreter, the float64 reference's output all the same."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 256, 32, generator=g).to(DEVICE) for _ in range(3))
    p = problem(4.0 * q, k, v, norm="entmax", causal=True, alpha=1.5)
    stats = StreamStats()
    out, _ = run_problem(p, block_size=64, stats=stats)
    ref = attend(4.0 * q.double(), k.double(), v.double(), norm="entmax", causal=True, alpha=1.5)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)
    if DEVICE.type == "cpu":
        assert sum(stats.program_threshold_passes) <= 43, stats.program_threshold_passes


def test_entmax_prefill_takes_at_most_two_stages():
    """At 3 stages entmax's prefill takes 119 KB of shared memory (its 128-key sweeps' K tiles), too much for two
    programs on an SM; the host caps every path at 2 (`sharp-bench kernels --static` holds the shared memory)."""
    assert host.entmax_stages(3) == host.entmax_stages(2) == 2
    assert host.entmax_stages(1) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_entmax_output_skips_the_tiles_without_weight(dtype):
    """The output sweep skips the V load and P·V of a tile whose weights are all 0, read from the tile's Z (its
    (rows, 16) partials in half precision). Sharp rows (logits of standard deviation 16) leave most tiles of a causal
    prefill without weight: the kernel's count lies between the visited tiles whose every key is clearly below τ and
    those with no key clearly above it (by 1e-3, from float64), and is not 0."""
    from sharp.models.normalizers import _bisect_threshold, _shifted_entmax_input

    g = torch.Generator().manual_seed(11)
    length, d = 512, 16
    q, k, v = (torch.randn(1, 2, length, d, generator=g) for _ in range(3))
    q = q * 16.0
    p = problem(*(t.to(DEVICE, dtype) for t in (q, k, v)), norm="entmax", causal=True, alpha=1.25)
    stats = StreamStats()
    run_problem(p, block_size=64, stats=stats)
    cfg = launch_config(p, block_size=64)
    z = (p.q.double() @ p.k.double().transpose(-1, -2)) * d**-0.5
    z = z.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    am1 = torch.tensor(0.25, dtype=torch.float64)
    u, _ = _shifted_entmax_input(z, am1, -1)
    gap = u - _bisect_threshold(u, am1, -1)  # > 0 on the support; hidden keys at −2 − τ < −1
    clearly_dead = possibly_dead = 0
    for qb in range(-(-length // cfg.block_m)):
        rows = gap[..., qb * cfg.block_m : (qb + 1) * cfg.block_m, :]
        for start in range(0, min((qb + 1) * cfg.block_m, length), cfg.block_n):  # the tiles the pass visits
            top = rows[..., start : start + cfg.block_n].amax(dim=(-1, -2))
            clearly_dead += int((top < -1e-3).sum())
            possibly_dead += int((top < 1e-3).sum())
    assert stats.tiles_skipped > 0 and clearly_dead <= stats.tiles_skipped <= possibly_dead, (
        clearly_dead, stats.tiles_skipped, possibly_dead)  # fmt: skip


def _root(x: torch.Tensor, k: float | torch.Tensor) -> torch.Tensor:
    """τ with Σ [x − τ]_+^k = 1 per row of x (float64, ≤ 0 with a 0 per row; −inf: no key; k: one, or one per row as
    a column), by bisection on [−1, 0]."""
    lo, hi = torch.full(x.shape[:1], -1.0, dtype=torch.float64), torch.zeros(x.shape[:1], dtype=torch.float64)
    for _ in range(100):
        mid = (lo + hi) / 2
        above = ((x - mid[:, None]).clamp(min=0) ** k).sum(1) > 1
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return lo


@pytest.mark.parametrize("alpha", [1.25, 1.5, 1.75, 2.0, 3.0])
def test_threshold_seed_lies_at_or_below_the_root(alpha):
    """The entmax kernels' search starts at the root of the same problem on the row's maxima over its key classes
    j ≡ c (mod 16): at or below the row's own root (those maxima are keys of the row, so their S is never larger), and
    for α < 2 — where Newton's step on S^(1/k), convex, cannot pass their root — within 10⁻³ of that root after its
    three steps. Rows: diffuse and sharp logits of 1,000 keys, a few keys (most classes empty), one key, none (the
    seed is then the bracket's low end, −1)."""
    g = torch.Generator().manual_seed(5)
    k = 1.0 / (alpha - 1.0)
    sigma = torch.linspace(0.5, 6, 64, dtype=torch.float64)[:, None]
    z = torch.randn(64, 1000, generator=g, dtype=torch.float64) * sigma
    z[56:62] = z[56:62].masked_fill(5 + torch.arange(6)[:, None] <= torch.arange(1000), float("-inf"))  # 5 to 10 keys
    z[62, 1:] = float("-inf")
    z[63] = float("-inf")
    u = (alpha - 1.0) * z
    x = u - u.max(1, keepdim=True).values.nan_to_num(neginf=0.0)
    x_c = torch.stack([x[:, c::PARTIALS].amax(1) for c in range(PARTIALS)], 1)
    tau = torch.empty(64, device=DEVICE)
    _seed_probe[(1,)](x_c.float().to(DEVICE), torch.tensor([k], device=DEVICE), tau, ROWS=64)
    tau = tau.double().cpu()
    live = torch.arange(64) < 63
    assert tau[63].item() == -1.0
    full = _root(x[live], k)
    assert (tau[live] <= full + 4 * torch.finfo(torch.float32).eps).all()
    assert (tau[live] >= -1.0).all()
    if alpha < 2.0:
        sub = _root(x_c[live], k)
        assert (tau[live] - sub).abs().max() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shift_columns_hold_max_t_exactly(dtype):
    """The threshold and output sweeps take t − max t from the tensor cores: Q·Kᵀ accumulated with the product of
    the shift columns (−s in three parts of the inputs' type, `_shift_columns`) and their key-side rows of scales. The
    parts hold fp32's 24 bits exactly, across the magnitudes a row max takes (fp16's parts scaled by 2^11, 1 and
    2^-11: its range ends at 65504)."""
    s = torch.tensor([0.0, 1.0, -1.0, 0.1, 3.14159265, -7.77e-3, 12345.678, -98765.43, 2.5e6, -1.25e8, 0.3333333,
                      1e-2, 0.13, 4096.001, -65519.9, 8.0e7], dtype=torch.float32)  # fmt: skip
    cols, rows = (torch.zeros(16, PARTIALS, dtype=torch.float32, device=DEVICE) for _ in range(2))
    _shift_probe[(1,)](s.to(DEVICE), cols, rows, DT=_TL_TYPES[dtype])
    total = (cols.double().cpu() * rows.double().cpu()[0]).sum(-1)  # every key's scales are alike (below)
    assert torch.equal(total, -s.double()), total + s.double()
    assert torch.equal(rows[1:], rows[:1].expand(15, -1)) and int((rows[0] != 0).sum()) == 3


def _rows_with_a_hidden_key(seed: int, k: float, twice: bool = False) -> tuple[torch.Tensor, ...]:
    """16 rows of 256 values x = u − max u: 16 class maxima in (−0.6, 0], in three rows of four a hidden key 0.05
    under one of the three largest (the next key of its class), with `twice` a second one in every fourth row 0.1
    under that max (two hidden in one class) and in every fourth of the others 0.05 under another of the three (one
    hidden in each of two classes), 240 keys far below. Returns x, its class maxima, the float64 root, which rows
    have a hidden key, which a second in the same class, and the first's column (the second's is that plus the class
    count)."""
    g = torch.Generator().manual_seed(seed)
    rows, lk, n = 16, 256, PARTIALS.value
    x = torch.full((rows, lk), -5.0, dtype=torch.float64) - torch.rand(rows, lk, generator=g, dtype=torch.float64)
    x[:, :n] = -0.6 * torch.rand(rows, n, generator=g, dtype=torch.float64)
    x[:, 0] = 0.0
    r = torch.arange(rows)
    hidden = r % 4 != 0
    second = hidden & (r % 4 == 3) & twice
    apart = hidden & (r % 4 == 2) & twice
    top = x[:, :n].argsort(1, descending=True)
    col = n + top[r, r % 3]
    x[hidden, col[hidden]] = x[hidden, col[hidden] - n] - 0.05
    x[second, col[second] + n] = x[second, col[second] - n] - 0.1
    other = n + top[r, (r + 1) % 3]
    x[apart, other[apart]] = x[apart, other[apart] - n] - 0.05
    x = x.float().double()  # values the kernel holds exactly
    x_c = torch.stack([x[:, c::n].amax(1) for c in range(n)], 1)
    return x, x_c, _root(x, k), hidden, second, col


def _model_root(x, x_c, k, tau):
    out, exact = torch.empty(x.shape[0], device=DEVICE), torch.zeros(x.shape[0], dtype=torch.int32, device=DEVICE)
    _class_probe[(1,)](
        x.float().to(DEVICE), x_c.float().to(DEVICE), torch.full((x.shape[0],), k, device=DEVICE),
        tau.float().to(DEVICE), out, exact, x.shape[1], host.THRESHOLD_TOL, ROWS=x.shape[0], BLOCK_N=64,
    )  # fmt: skip
    return out.double().cpu(), exact.cpu().bool()


@pytest.mark.parametrize("alpha", [1.6, 1.75, 2.0])
def test_class_model_finds_the_root_of_a_row_with_one_hidden_key(alpha):
    """Newton's rows step to the root of a model whose class maxima are exact and whose hidden keys (below their
    class's max) are one key per class, fitted to the pass's sums per class. A class that hides one key is that key,
    so a row whose support is class maxima and hidden keys one to a class gets its root from one pass, from wherever
    below the root it was taken (`_rows_with_a_hidden_key`; τ 0.02 to 0.3 below the root). At α = 2 the pass counts
    the support, so the model knows it is exact there — once its Newton's steps have reached its root."""
    k = 1.0 / (alpha - 1.0)
    x, x_c, root, hidden, _, col = _rows_with_a_hidden_key(11, k)
    assert (x[hidden, col[hidden]] > root[hidden]).all()  # the hidden key is in the support at the root
    out, exact = _model_root(x, x_c, k, root - torch.linspace(0.02, 0.3, 16, dtype=torch.float64))
    err = (out - root).abs()
    assert err.max() <= 2e-6, err
    if alpha == 2.0:  # where its Newton's steps reached the root (convex, piecewise linear: one step per piece)
        assert int(exact.sum()) >= 12, exact
        # from the bracket's low end the model's S has more pieces than four steps cross: not exact there
        out, exact = _model_root(x, x_c, k, torch.full((16,), -0.999, dtype=torch.float64))
        assert 0 < int(exact.sum()) < 16 and (out - root)[exact].abs().max() <= 2e-6, (exact, out - root)
    else:
        assert not exact.any(), exact


@pytest.mark.parametrize("alpha", [2.0, 2.5, 3.0, 4.0])
def test_class_root_knows_when_it_is_exact(alpha):
    """α ≥ 2: the pass counts the support per class (Σ d^0, or the third sum at α > 2), so the class model knows
    where each class hides at most one key in it: from a τ at or below the root its root is then the row's, where
    keys only leave the support (one hidden key is its class's fitted key). A class that hides two keys in the
    support at τ, or τ above the root (keys may enter as it falls), is reported (not exact), its model root still
    near — at α > 2 within 10⁻⁶, the class's two keys fitted to its shares (`_two_keys`) — (`_rows_with_a_hidden_key`
    with second hidden keys, in the same class or in another; τ 0.02 to 0.3 below the root, or in every fourth row
    from the second above it). α > 2 bisects the model (S is concave between keys), α = 2 takes Newton's steps."""
    k = 1.0 / (alpha - 1.0)
    x, x_c, root, _, second, col = _rows_with_a_hidden_key(13, k, twice=True)
    tau = root - torch.linspace(0.02, 0.3, 16, dtype=torch.float64)
    high = torch.arange(16) % 4 == 1  # τ above the root (and below the max)
    tau[high] = root[high] + 0.5 * (x[high, : PARTIALS.value].topk(2, 1).values[:, 1] - root[high])
    rows = torch.arange(16)
    two = second & (x[rows, col] > tau) & (x[rows, col + PARTIALS.value] > tau)  # in the support at τ
    assert 0 < int(two.sum()) < int(second.sum()) + 1
    out, exact = _model_root(x, x_c, k, tau)
    if alpha == 2.0:  # and where its Newton's steps reached the model's root (one step per piece of S)
        assert not (exact & (two | high)).any() and int(exact.sum()) >= int((~two & ~high).sum()) - 2, exact
    else:
        assert torch.equal(exact, ~two & ~high), (exact, two, high)
    err = (out - root).abs()
    assert err[exact].max() <= 2e-6, err
    assert err[~exact & ~high].max() <= (0.05 if alpha == 2.0 else 1e-6), err  # α > 2: the two keys fitted


def test_sparsemax_threshold_kernel_takes_an_exact_step_without_confirming_it():
    """α = 2 (sparsemax, FAST = 1): S is piecewise linear, so a step shorter than the distance from τ to the row's
    nearest key — kept by the threshold sweep as a max of −|x − τ| — lands on the root and needs no pass to confirm
    it. Split-K decode's threshold kernel over 4,096 logits per row, diffuse and sharp: τ within the tolerance of the
    float64 root in one pass per row — the class model per key class, exact where the pass's count shows each class
    hiding at most one key in the support (under the earlier 16-row programs of 64 classes, a model of one hidden
    key per row took 8 and 4 passes over four programs, 9 and 5 without the nearest-key rule too), counted in the
    interpreter; and rows of keys 10⁻⁵ apart below the max (436 in the support, some of the 512 classes hiding
    several), where a step that crosses keys misses the root (a rule that let steps 10⁻³ past that distance: τ off
    by 8.5·10⁻⁵), in at most 3 passes a row (6 with 64 classes)."""
    from sharp.models.streamed import MAX_THRESHOLD_PASSES
    from sharp.plugins.triton.attention import THRESHOLD_KEYS, THRESHOLD_ROWS, THRESHOLD_TOL
    from sharp.plugins.triton.decode import _entmax_threshold_kernel

    g = torch.Generator().manual_seed(3)
    dense = -0.05 - 1e-5 * torch.arange(4096.0) - 2e-6 * torch.rand(64, 4096, generator=g)  # keys 10⁻⁵ apart
    dense[:, 0] = 0.0
    for sigma, bound in ((1.0, 1), (4.0, 1), (None, 3)):
        u = torch.randn(64, 4096, generator=g) * sigma if sigma else dense[:, torch.randperm(4096, generator=g)]
        umax, tau = torch.empty(64, device=DEVICE), torch.empty(64, device=DEVICE)
        counts = torch.zeros(64 // THRESHOLD_ROWS, dtype=torch.int32, device=DEVICE)
        _entmax_threshold_kernel[(64 // THRESHOLD_ROWS,)](
            u.to(DEVICE), torch.tensor([2.0, 2.0], device=DEVICE), umax, tau, counts, 2, 1, u.shape[1], 64,
            MAX_THRESHOLD_PASSES, THRESHOLD_TOL, FAST=1, COUNT=True, BLOCK_R=THRESHOLD_ROWS, BLOCK_N=THRESHOLD_KEYS,
        )  # fmt: skip
        x = u.double() - umax.double().cpu()[:, None]
        assert (tau.double().cpu() - _root(x, 1.0)).abs().max() <= THRESHOLD_TOL
        if DEVICE.type == "cpu":
            assert counts.max().item() <= bound, (sigma, counts.tolist())


def _newton_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """64 rows of 4,096 values u = (α − 1)·z, z ~ N(0, 1), α = 1.75 and 1.6 by turns (Newton's rows: S'' not summed),
    and each row's α."""
    g = torch.Generator().manual_seed(3)
    alpha = torch.tensor([1.75, 1.6]).repeat(32)
    return (alpha[:, None] - 1.0) * torch.randn(64, 4096, generator=g), alpha


def test_entmax_threshold_kernel_finds_tau_within_the_tolerance_in_few_passes():
    """Split-K decode's threshold step over 4,096 logits per row at α = 1.75 and 1.6: τ within the tolerance of the
    float64 root in at most 2 passes a row (1.97 on average) — seeded from its 512 key classes' maxima and stepped to
    the root of their class model, per class (with 16-row programs of 64 classes: 8 over the four programs; 10 with
    one hidden key per row, 12 without the model, 18 from the bracket's end; 14 without the settling rule) —
    counted in the interpreter, whose fp32 is NumPy's (a GPU's MUFU may round a pass apart)."""
    from sharp.models.streamed import MAX_THRESHOLD_PASSES
    from sharp.plugins.triton.attention import THRESHOLD_KEYS, THRESHOLD_ROWS, THRESHOLD_TOL
    from sharp.plugins.triton.decode import _entmax_threshold_kernel

    u, alpha = _newton_rows()
    rows = u.shape[0]  # one query per sequence of 2 heads: row r is head r % 2
    umax, tau = torch.empty(rows, device=DEVICE), torch.empty(rows, device=DEVICE)
    programs = -(-rows // THRESHOLD_ROWS)
    counts = torch.zeros(programs, dtype=torch.int32, device=DEVICE)
    _entmax_threshold_kernel[(programs,)](
        u.to(DEVICE), alpha[:2].to(DEVICE), umax, tau, counts, 2, 1, u.shape[1], rows, MAX_THRESHOLD_PASSES,
        THRESHOLD_TOL, FAST=0, COUNT=True, BLOCK_R=THRESHOLD_ROWS, BLOCK_N=THRESHOLD_KEYS,
    )  # fmt: skip
    x = u.double() - umax.double().cpu()[:, None]
    assert (tau.double().cpu() - _root(x, 1.0 / (alpha.double()[:, None] - 1.0))).abs().max() <= THRESHOLD_TOL
    if DEVICE.type == "cpu":
        assert counts.max().item() <= 2, counts.tolist()


@pytest.mark.parametrize("alpha", [2.5, 3.0])
def test_entmax_threshold_kernel_counts_the_support_above_alpha_2(alpha):
    """α > 2: the selecting sweep counts the keys in the support per key class (its third sum), so the class model
    knows where it is exact. Split-K decode's threshold kernel over 4,096 logits u = (α − 1)·z, z ~ N(0, 1), per row:
    τ within the tolerance of the float64 root in one pass per row, counted in the interpreter."""
    from sharp.models.streamed import MAX_THRESHOLD_PASSES
    from sharp.plugins.triton.attention import THRESHOLD_KEYS, THRESHOLD_ROWS, THRESHOLD_TOL
    from sharp.plugins.triton.decode import _entmax_threshold_kernel

    g = torch.Generator().manual_seed(5)
    u = (alpha - 1.0) * torch.randn(64, 4096, generator=g)
    umax, tau = torch.empty(64, device=DEVICE), torch.empty(64, device=DEVICE)
    counts = torch.zeros(64 // THRESHOLD_ROWS, dtype=torch.int32, device=DEVICE)
    _entmax_threshold_kernel[(64 // THRESHOLD_ROWS,)](
        u.to(DEVICE), torch.tensor([alpha, alpha], device=DEVICE), umax, tau, counts, 2, 1, u.shape[1], 64,
        MAX_THRESHOLD_PASSES, THRESHOLD_TOL, FAST=0, COUNT=True, BLOCK_R=THRESHOLD_ROWS, BLOCK_N=THRESHOLD_KEYS,
    )  # fmt: skip
    x = u.double() - umax.double().cpu()[:, None]
    assert (tau.double().cpu() - _root(x, 1.0 / (alpha - 1.0))).abs().max() <= THRESHOLD_TOL
    if DEVICE.type == "cpu":
        assert counts.tolist() == [1] * (64 // THRESHOLD_ROWS), counts.tolist()


def test_threshold_steps_from_the_bracket_end_find_tau_in_few_passes():
    """The search's own steps from the bracket's low end — without the seed or the class model — on the decode test's
    rows (α = 1.75 and 1.6: Newton's rows): τ within the tolerance of the float64 root, in 18 passes over four 16-row
    groups (23 with the far steps' exponent held at 1/(α − 1); 27 with Newton's step alone, 26 without the settling
    rule, which trusts the curvature from the previous pass's S' only when its error estimate is a quarter of the
    tolerance) — counted in the interpreter."""
    from sharp.models.streamed import MAX_THRESHOLD_PASSES
    from sharp.plugins.triton.attention import THRESHOLD_TOL

    u, alpha = _newton_rows()
    x = u - u.amax(1, keepdim=True)
    tau, passes = torch.empty(64, device=DEVICE), 0
    for r in range(0, 64, 16):
        count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        _search_probe[(1,)](
            x[r : r + 16].contiguous().to(DEVICE), alpha[r : r + 16].to(DEVICE), tau[r:], count, x.shape[1],
            MAX_THRESHOLD_PASSES, THRESHOLD_TOL, ROWS=16, BLOCK_N=64,
        )  # fmt: skip
        passes += count.item()
    assert (tau.double().cpu() - _root(x.double(), 1.0 / (alpha.double()[:, None] - 1.0))).abs().max() <= THRESHOLD_TOL
    if DEVICE.type == "cpu":
        assert passes <= 18
