"""The normalizers against docs/design.md: properties, independent oracles, gradients, bad inputs."""

from __future__ import annotations

import entmax as entmax_pkg
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sharp.models import normalizers as N

NEG_INF = float("-inf")
ALL = {
    "softmax": lambda x: N.softmax(x),
    "adaptive": lambda x: N.adaptive_softmax(x),
    "ssmax": lambda x: N.ssmax(x, s=0.7),
    "entmax15": lambda x: N.entmax(x, 1.5),
    "sparsemax": lambda x: N.entmax(x, 2.0),
    "entmax13": lambda x: N.entmax(x, 1.3),
    "ssa": lambda x: N.ssa(x, n=1.5, b=1.0),
}

finite = st.floats(-50, 50, allow_nan=False, width=32)
rows = arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 40)), elements=finite)
masks = st.data()


def _masked(x: np.ndarray, data) -> torch.Tensor:
    """Mask a random subset of entries with -inf (some rows possibly fully masked)."""
    m = data.draw(arrays(np.bool_, x.shape))
    return torch.from_numpy(np.where(m, -np.inf, x).astype(np.float32))


@pytest.mark.parametrize("name", list(ALL))
@settings(max_examples=60, deadline=None)
@given(x=rows, data=masks)
def test_simplex_exact_zeros_and_fully_masked_rows(name, x, data):
    z = _masked(x, data)
    p = ALL[name](z)
    visible = (z > NEG_INF).any(-1)
    assert torch.isfinite(p).all()
    assert (p >= 0).all()
    assert (p[z == NEG_INF] == 0).all()
    sums = p.sum(-1)
    torch.testing.assert_close(sums[visible], torch.ones_like(sums[visible]), atol=1e-5, rtol=0)
    assert (p[~visible] == 0).all()


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
@settings(max_examples=60, deadline=None)
@given(x=rows)
def test_entmax_zero_beyond_gap(alpha, x):
    """τ ≥ max u − 1, so any entry with (α−1)(max z − z_j) ≥ 1 gets exactly zero weight."""
    z = torch.from_numpy(x)
    p = N.entmax(z, alpha)
    gap = (alpha - 1) * (z.max(-1, keepdim=True).values - z)
    assert (p[gap > 1.0 + 1e-5] == 0).all()


@settings(max_examples=60, deadline=None)
@given(x=rows, c=st.floats(-30, 30, width=32))
def test_softmax_shift_invariant_entmax_too(x, c):
    z = torch.from_numpy(x)
    torch.testing.assert_close(N.softmax(z + c), N.softmax(z), atol=1e-5, rtol=0)
    torch.testing.assert_close(N.entmax(z + c, 1.5), N.entmax(z, 1.5), atol=1e-4, rtol=0)


def test_ssa_is_not_shift_invariant():
    z = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    assert (N.ssa(z + 3.0) - N.ssa(z)).abs().max() > 1e-2
    # and is softmax of the log form: p ∝ (1 + b|z|)^{sgn(z) n}
    f = (1 + 0.7 * z.abs()) ** (torch.sign(z) * 2.0)
    torch.testing.assert_close(N.ssa(z, n=2.0, b=0.7), f / f.sum(-1, keepdim=True))


@settings(max_examples=60, deadline=None)
@given(x=rows, b1=st.floats(0.0, 5.0), b2=st.floats(0.0, 5.0))
def test_entropy_monotone_in_inverse_temperature(x, b1, b2):
    z = torch.from_numpy(x).double()
    lo, hi = sorted((b1, b2))
    assert (N.entropy(N.softmax(hi * z)) <= N.entropy(N.softmax(lo * z)) + 1e-9).all()


@settings(max_examples=100, deadline=None)
@given(x=rows)
def test_adaptive_never_increases_entropy(x):
    z = torch.from_numpy(x).double()
    assert (N.entropy(N.adaptive_softmax(z)) <= N.entropy(N.softmax(z)) + 1e-9).all()


def test_paper_polynomial_order():
    h = torch.tensor([3.0, 5.0, 6.0, 0.4])
    beta = N.adaptive_beta(h)
    torch.testing.assert_close(beta[:2], torch.tensor([2.25, 2.29]), atol=6e-3, rtol=0)
    assert beta[2] == 1.0 and beta[3] == 1.0  # poly(6) ≈ 0.86 is clamped; H ≤ 0.5 never corrected
    np.testing.assert_allclose(float(N.polyval(N.PAPER_POLY, h[:1])), np.polyval(N.PAPER_POLY, 3.0), rtol=1e-6)


def _paper_adaptive_numpy(logits: np.ndarray, poly) -> np.ndarray:
    """Float64 NumPy port of the paper's JAX `adaptive_temperature_softmax` (softmax-is-not-enough §3)."""

    def softmax(a):
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p = softmax(logits)
    h = np.sum(-p * np.log(p + 1e-9), axis=-1, keepdims=True)
    beta = np.where(h > 0.5, np.maximum(np.polyval(poly, h), 1.0), 1.0)
    return softmax(logits * beta)


@pytest.mark.parametrize("spread", [0.1, 1.0, 3.0, 10.0])
def test_adaptive_matches_paper_code(spread):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 200)) * spread
    expect = _paper_adaptive_numpy(x, N.PAPER_POLY)
    got = N.adaptive_softmax(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, expect, atol=1e-6)
    sharpened = N.entropy(torch.from_numpy(got)) < N.entropy(N.softmax(torch.from_numpy(x))) - 1e-3
    if spread <= 1.0:  # dispersed rows (H > 0.5 and β > 1) must actually be sharpened
        assert sharpened.all()


@pytest.mark.parametrize(
    ("alpha", "oracle", "tol"),
    [
        (1.5, lambda x: entmax_pkg.entmax15(x, dim=-1), 1e-6),
        (2.0, lambda x: entmax_pkg.sparsemax(x, dim=-1), 1e-6),
        (1.1, lambda x: entmax_pkg.entmax_bisect(x, 1.1), 1e-5),
        (1.3, lambda x: entmax_pkg.entmax_bisect(x, 1.3), 1e-5),
        (1.7, lambda x: entmax_pkg.entmax_bisect(x, 1.7), 1e-5),
        (2.0, lambda x: entmax_pkg.entmax_bisect(x, 2.0), 1e-5),
        (2.5, lambda x: entmax_pkg.entmax_bisect(x, 2.5), 1e-3),
        (3.0, lambda x: entmax_pkg.entmax_bisect(x, 3.0), 1e-3),
    ],
)
@pytest.mark.parametrize("scale", [0.5, 3.0, 30.0])
def test_entmax_matches_entmax_package(alpha, oracle, tol, scale):
    torch.manual_seed(1)
    x = torch.randn(40, 257) * scale
    torch.testing.assert_close(N.entmax(x, alpha), oracle(x), atol=tol, rtol=0)
    # the same α given as a tensor goes through the generic search and must agree too
    torch.testing.assert_close(N.entmax(x, torch.tensor(alpha)), oracle(x), atol=max(tol, 1e-5), rtol=0)


def test_entmax_per_row_alpha_matches_package():
    torch.manual_seed(2)
    x = torch.randn(6, 100) * 2
    alpha = torch.tensor([1.2, 1.5, 1.8, 2.0, 1.05, 1.5]).unsqueeze(-1)
    expect = entmax_pkg.entmax_bisect(x, alpha)
    torch.testing.assert_close(N.entmax(x, alpha), expect, atol=1e-5, rtol=0)


def test_entmax_alpha_one_is_softmax_and_below_one_rejected():
    x = torch.randn(3, 9)
    torch.testing.assert_close(N.entmax(x, 1.0), N.softmax(x))
    torch.testing.assert_close(N.entmax(x, torch.tensor([[1.0], [1.5], [1.0]]))[0], N.softmax(x)[0])
    with pytest.raises(ValueError, match="alpha >= 1"):
        N.entmax(x, 0.9)
    with pytest.raises(ValueError, match="alpha >= 1"):
        N.entmax(x, torch.tensor([0.5]))


def test_entmax_is_sparse_softmax_is_not():
    torch.manual_seed(3)
    x = torch.randn(8, 500) * 2
    assert (N.entmax(x, 1.5) == 0).float().mean() > 0.5
    assert (N.softmax(x) > 0).all()


def _rand64(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.3, 1.8])
def test_entmax_gradcheck_input(alpha):
    x = (_rand64(4, 12) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: N.entmax(t, alpha), (x,))


def test_entmax_gradcheck_tensor_alpha():
    x = (_rand64(5, 10, seed=1) * 2).requires_grad_()
    alpha = torch.tensor([[1.3], [1.5], [1.7], [2.2], [1.4]], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, a: N.entmax(t, a), (x, alpha))
    # per-head α broadcast over (B, H, L, N) rows: the gradient is reduced back to α's shape
    x4 = (_rand64(2, 3, 4, 7, seed=2) * 2).requires_grad_()
    a4 = torch.tensor([1.3, 1.6, 2.1], dtype=torch.float64).view(3, 1, 1).requires_grad_()
    assert torch.autograd.gradcheck(lambda t, a: N.entmax(t, a), (x4, a4))


def test_softmax_family_gradcheck_with_parameters():
    x = (_rand64(3, 9, seed=4) * 2).requires_grad_()
    n = torch.tensor([[1.5], [2.0], [1.2]], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([[1.0], [0.5], [2.0]], dtype=torch.float64, requires_grad=True)
    s = torch.tensor([[0.8], [1.2], [0.3]], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, n_, b_: N.ssa(t, n_, b_), (x, n, b))
    assert torch.autograd.gradcheck(lambda t, s_: N.ssmax(t, s_), (x, s))
    assert torch.autograd.gradcheck(N.softmax, (x,))
    assert torch.autograd.gradcheck(N.adaptive_softmax, ((_rand64(3, 9, seed=5) * 0.3).requires_grad_(),))


def test_ssa_gradient_at_zero_is_n_times_b():
    x = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(N.ssa_logits(x, 1.5, 2.0).sum(), x)
    assert float(g) == pytest.approx(3.0)


def test_masked_entries_have_zero_gradient_and_no_nan():
    x = torch.tensor([[1.0, NEG_INF, 0.5, -2.0], [NEG_INF] * 4], requires_grad=True)
    for f in ALL.values():
        x.grad = None
        (f(x) * torch.arange(4.0)).sum().backward()
        assert torch.isfinite(x.grad).all()
        assert (x.grad[:, 1] == 0).all() and (x.grad[1] == 0).all()


@pytest.mark.parametrize("name", list(ALL))
def test_large_logits_stay_finite(name):
    torch.manual_seed(5)
    x = (torch.rand(16, 64) * 2 - 1) * 1e4
    p = ALL[name](x)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(16), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(ALL))
def test_nan_or_plus_inf_poisons_only_its_row(name):
    x = torch.tensor([[0.1, 0.2, 0.3], [float("nan"), 0.0, 1.0], [float("inf"), 0.0, 1.0]])
    p = ALL[name](x)
    assert torch.isnan(p[1]).all() and torch.isnan(p[2]).all()
    assert torch.isfinite(p[0]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(ALL))
def test_half_inputs_computed_in_fp32(name, dtype):
    torch.manual_seed(6)
    x = (torch.randn(8, 50) * 4).to(dtype)
    p = ALL[name](x)
    assert p.dtype == dtype
    expect = ALL[name](x.float()).to(dtype)
    torch.testing.assert_close(p, expect, atol=0, rtol=0)


def test_ssmax_scales_with_visible_length():
    x = torch.tensor([[1.0, 0.0, 0.0, NEG_INF]])
    expect = N.softmax(0.5 * np.log(3.0) * x)
    torch.testing.assert_close(N.ssmax(x, 0.5), expect)
    torch.testing.assert_close(N.ssmax(x, 0.5, length=10), N.softmax(0.5 * np.log(10.0) * x))
    single = torch.tensor([[2.0, NEG_INF]])  # one visible key: log 1 = 0, still a valid one-hot row
    torch.testing.assert_close(N.ssmax(single), torch.tensor([[1.0, 0.0]]))


def test_entropy_values():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.25] * 3 + [0.25]][:2])
    torch.testing.assert_close(N.entropy(p), torch.tensor([np.log(2.0), 0.0], dtype=torch.float32))
    torch.testing.assert_close(N.entropy(torch.full((1, 8), 0.125)), torch.tensor([np.log(8.0)]).float())


def test_normalize_rejects_unknown_norm():
    from sharp.models.registry import normalize

    with pytest.raises(ValueError, match="valid: softmax, adaptive"):
        normalize(torch.zeros(1, 2), "sparsemax")
