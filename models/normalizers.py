"""The six attention normalizers as a tiny functional API (in the style of the `entmax` package).

Every normalizer maps logits to a distribution along `dim`: `p >= 0`, `sum(p) == 1`, exact zeros for masked
(`-inf`) logits, an all-zero row when every logit is masked (never NaN). Half-precision inputs are computed
in fp32 and returned in their own dtype. A row containing NaN or `+inf` is not a valid logit row and comes
back as NaN (only that row): the error stays visible instead of being silently renormalised.

Tensor parameters (per-head α, SSA n and b, SSMax s) must broadcast against the input with `dim` kept,
e.g. shape (H, 1, 1) for logits (B, H, Lq, Lk); they are differentiable.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# adaptive's defaults live in the registry's torch-free table (β(H) in numpy.polyval order: β(3) ≈ 2.25)
from sharp.models.registry import ADAPTIVE_THRESHOLD, PAPER_POLY

Param = float | Tensor

_NEG_INF = float("-inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 are computed in fp32; fp32 and fp64 keep their precision."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _as_param(value: Param, like: Tensor) -> Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def transform_visible(x: Tensor, fn) -> Tensor:
    """Apply a logit transform to the unmasked entries; masked (-inf) stay -inf.

    The transform sees 0 at masked places: it must never see -inf, or its discarded branch would turn the
    gradient of its parameters into 0 · ∞ = NaN (and 0 · -inf forward when ssmax's factor log 1 is 0).
    """
    masked = x == _NEG_INF
    return torch.where(masked, _NEG_INF, fn(torch.where(masked, 0.0, x)))


def _softmax_fp(x: Tensor, dim: int) -> Tensor:
    """Softmax in x's own (full-precision) dtype; fully masked rows give zeros, NaN/+inf rows NaN."""
    m = x.detach().amax(dim=dim, keepdim=True)
    invalid = torch.isnan(m) | (m == float("inf"))
    m = torch.where((m == _NEG_INF) | invalid, 0.0, m)
    e = torch.exp(x - m)
    s = e.sum(dim=dim, keepdim=True)
    return torch.where(invalid, float("nan"), e / torch.where(s > 0, s, 1.0))


def polyval(coeffs: tuple[float, ...] | Tensor, x: Tensor) -> Tensor:
    """Horner evaluation, highest power first (numpy.polyval order)."""
    out = torch.zeros_like(x)
    for c in coeffs:
        out = out * x + c
    return out


def adaptive_beta(
    h: Tensor, poly: tuple[float, ...] | Tensor = PAPER_POLY, threshold: float = ADAPTIVE_THRESHOLD
) -> Tensor:
    """Inverse temperature β from the entropy H of the softmax row: max(poly(H), 1) above the threshold, else 1."""
    return torch.where(h > threshold, polyval(poly, h).clamp_min(1.0), torch.ones_like(h))


def entropy(p: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy −Σ_{p>0} p log p in nats (zeros contribute nothing, with a finite gradient)."""
    pf = p.to(compute_dtype(p.dtype))
    pos = pf > 0
    terms = torch.where(pos, pf * torch.log(torch.where(pos, pf, 1.0)), 0.0)
    return (0.0 - terms.sum(dim=dim)).to(p.dtype)  # 0 − x, so an empty sum is +0.0, not −0.0


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """exp(x − max x) / Σ, with masked and fully masked rows handled as the module docstring says."""
    return _softmax_fp(x.to(compute_dtype(x.dtype)), dim).to(x.dtype)


def adaptive_softmax(
    x: Tensor, dim: int = -1, poly: tuple[float, ...] | Tensor = PAPER_POLY, threshold: float = ADAPTIVE_THRESHOLD
) -> Tensor:
    """Adaptive-temperature softmax (Veličković et al.): softmax(β(H) x) with H the entropy of softmax(x)."""
    xf = x.to(compute_dtype(x.dtype))
    h = entropy(_softmax_fp(xf, dim), dim=dim).unsqueeze(dim)
    beta = adaptive_beta(h, poly, threshold)
    return _softmax_fp(transform_visible(xf, lambda t: beta * t), dim).to(x.dtype)


def visible_count(x: Tensor, dim: int = -1) -> Tensor:
    """Number of unmasked (> -inf) entries per row, with `dim` kept."""
    return (x != _NEG_INF).sum(dim=dim, keepdim=True)


def ssmax(x: Tensor, s: Param = 1.0, dim: int = -1, length: int | Tensor | None = None) -> Tensor:
    """Scalable softmax (Nakanishi): softmax(s · log(n) · x), n = visible keys of the row unless `length`."""
    xf = x.to(compute_dtype(x.dtype))
    n = visible_count(xf, dim) if length is None else torch.as_tensor(length, device=x.device)
    factor = _as_param(s, xf) * torch.log(n.to(xf.dtype).clamp_min(1.0))
    return _softmax_fp(transform_visible(xf, lambda t: factor * t), dim).to(x.dtype)


def ssa_logits(x: Tensor, n: Param = 1.5, b: Param = 1.0) -> Tensor:
    """SSA's log-form transform g(z) = sgn(z) · n · log1p(b|z|); softmax of it is (1 + b|z|)^{sgn(z) n} / Σ.

    Written with two where-branches so the derivative at z = 0 is n·b (not 0) and no branch sees NaN.
    """
    n, b = _as_param(n, x), _as_param(b, x)
    pos = x >= 0
    x_pos = torch.where(pos, x, 0.0)
    x_neg = torch.where(pos, 0.0, -x)
    return n * torch.where(pos, torch.log1p(b * x_pos), -torch.log1p(b * x_neg))


def ssa(x: Tensor, n: Param = 1.5, b: Param = 1.0, dim: int = -1) -> Tensor:
    """Scaled signed averaging: p ∝ (1 + b|z|)^{sgn(z)·n}, computed as softmax(sgn(z) n log1p(b|z|))."""
    xf = x.to(compute_dtype(x.dtype))
    return _softmax_fp(transform_visible(xf, lambda t: ssa_logits(t, n, b)), dim).to(x.dtype)


# ----------------------------------------------------------------------------------------------- entmax


def _shifted_entmax_input(x: Tensor, am1: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """u = (α−1) x shifted so each row's max is 0; masked entries become −2, safely outside the support
    (τ ≥ max u − 1). Returns (u, all_masked_row)."""
    u = x * am1
    m = u.amax(dim=dim, keepdim=True)
    all_masked = m == _NEG_INF
    u = u - torch.where(all_masked, 0.0, m)
    return torch.where(x == _NEG_INF, -2.0, u), all_masked


def _sort_threshold_15(u: Tensor, dim: int) -> Tensor:
    """Exact τ for α = 1.5 (p = [u − τ]²) from the sorted row (Peters et al. 2019)."""
    us, _ = torch.sort(u, dim=dim, descending=True)
    k = torch.arange(1, u.shape[dim] + 1, device=u.device, dtype=u.dtype)
    k = k.view([-1 if d == dim % u.dim() else 1 for d in range(u.dim())])
    mean = us.cumsum(dim) / k
    mean_sq = (us * us).cumsum(dim) / k
    delta = ((1.0 - k * (mean_sq - mean * mean)) / k).clamp_min(0.0)
    tau = mean - torch.sqrt(delta)
    support = (tau <= us).sum(dim=dim, keepdim=True)
    return tau.gather(dim, support - 1)


def _sort_threshold_sparsemax(u: Tensor, dim: int) -> Tensor:
    """Exact τ for α = 2 (sparsemax, p = [u − τ]_+) from the sorted row."""
    us, _ = torch.sort(u, dim=dim, descending=True)
    k = torch.arange(1, u.shape[dim] + 1, device=u.device, dtype=u.dtype)
    k = k.view([-1 if d == dim % u.dim() else 1 for d in range(u.dim())])
    cs = us.cumsum(dim) - 1.0
    support = (k * us > cs).sum(dim=dim, keepdim=True)
    return cs.gather(dim, support - 1) / support.to(u.dtype)


def _bisect_threshold(u: Tensor, am1: Tensor, dim: int, halvings: int | None = None) -> Tensor:
    """τ with Σ [u − τ]_+^{1/(α−1)} = 1 by bisection on the bracket [max u − 1, max u − n^{1−α}] (max u = 0).

    The bracket has width ≤ 1 around values ≤ 1 in magnitude, so a fixed number of halvings reaches the
    dtype's resolution: 2^-30 in fp32, 2^-56 in fp64. With `halvings` given, that many, and the bracket's lower
    end is returned: a τ' ≤ τ within 2^-halvings (S(τ') ≥ 1 holds there at every step).
    """
    iters = halvings or (56 if u.dtype == torch.float64 else 30)
    inv = 1.0 / am1
    n = torch.as_tensor(float(u.shape[dim]), dtype=u.dtype, device=u.device)
    lo = torch.full_like(u.narrow(dim, 0, 1), -1.0)
    hi = (-torch.pow(n, -am1)).expand_as(lo)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        s = torch.clamp(u - mid, min=0.0).pow(inv).sum(dim=dim, keepdim=True)
        big = s >= 1.0
        lo = torch.where(big, mid, lo)
        hi = torch.where(big, hi, mid)
    return lo if halvings else 0.5 * (lo + hi)


def _exact_sort(alpha: Tensor) -> float | None:
    """1.5 or 2.0 where one α for all rows has a sort-based exact threshold; None: bisection."""
    return float(alpha) if alpha.numel() == 1 and float(alpha) in (1.5, 2.0) else None


def _threshold(u: Tensor, alpha: Tensor, dim: int) -> Tensor:
    """τ of rows u shifted to max 0 (`_shifted_entmax_input`). The sort-based thresholds run their cumulative sums
    in fp64: in fp32 a row of thousands of keys loses ~1e-5 of Σp (and of the entropy) to accumulated rounding."""
    if _exact_sort(alpha) == 1.5:
        return _sort_threshold_15(u.double(), dim).to(u.dtype)
    if _exact_sort(alpha) == 2.0:
        return _sort_threshold_sparsemax(u.double(), dim).to(u.dtype)
    return _bisect_threshold(u, alpha - 1.0, dim)


def entmax_threshold(x: Tensor, alpha: Tensor, dim: int = -1, halvings: int | None = None) -> Tensor:
    """τ of α-entmax over x along `dim` (kept), on u = (α−1)·x: p = [u − τ]_+^{1/(α−1)}. x finite or −inf (hidden),
    at least one finite entry per row; alpha (> 1) broadcastable against the rows. A τ computed on a subset of a
    row's entries is ≤ the row's own (docs/attention.md, "Sparse entmax decode"). `halvings` asks for a cheaper
    lower bound instead, ≤ τ and within 2^-halvings of it, where τ is searched by bisection (per-head α; the
    sort-based α = 1.5 and 2 are exact either way)."""
    dt = compute_dtype(x.dtype)
    a = alpha.to(dt)
    u, _ = _shifted_entmax_input(x.to(dt), a - 1.0, dim)
    shift = (x.to(dt) * (a - 1.0)).amax(dim=dim, keepdim=True)
    if halvings is not None and _exact_sort(a) is None:
        return _bisect_threshold(u, a - 1.0, dim, halvings) + shift
    return _threshold(u, a, dim) + shift


def _entmax_forward(x: Tensor, alpha: Tensor, dim: int) -> Tensor:
    # NaN / +inf rows are invalid: computed on zeros (so sorts and searches stay in range), returned as NaN.
    invalid = (torch.isnan(x) | (x == float("inf"))).any(dim=dim, keepdim=True)
    x = torch.where(invalid, 0.0, x)
    am1 = alpha - 1.0
    u, all_masked = _shifted_entmax_input(x, am1, dim)
    p = torch.clamp(u - _threshold(u, alpha, dim), min=0.0)
    if _exact_sort(alpha) == 1.5:
        p = p**2
    elif _exact_sort(alpha) is None:
        p = p.pow(1.0 / am1)
        p = p / p.sum(dim=dim, keepdim=True)
    p = torch.where(all_masked | (x == _NEG_INF), 0.0, p)
    return torch.where(invalid, float("nan"), p)


def _sum_to_param(grad: Tensor, alpha: Tensor) -> Tensor:
    """Reduce a gradient shaped like the rows back to α's (broadcast) shape."""
    while grad.dim() > alpha.dim():
        grad = grad.sum(0)
    return grad.sum_to_size(alpha.shape)


class _Entmax(torch.autograd.Function):
    """α-entmax with the closed-form backward of Peters et al. (2019) — never autograd through a sort or a loop.

    With g = p^{2−α} on the support: dz = g ⊙ dp − (Σ g·dp / Σ g) g. For a tensor α also
    dp/dα = (p − ĝ)/(α−1)² − (p log p − ĝ Σ p log p)/(α−1), ĝ = g / Σ g (derived from p = [(α−1)z − τ]^{1/(α−1)}).
    """

    @staticmethod
    def forward(ctx, x: Tensor, alpha: Tensor, dim: int) -> Tensor:  # type: ignore[override]
        p = _entmax_forward(x, alpha, dim)
        ctx.dim = dim
        ctx.save_for_backward(p, alpha)
        return p

    @staticmethod
    def backward(ctx, dp: Tensor):  # type: ignore[override]
        p, alpha = ctx.saved_tensors
        dim = ctx.dim
        support = p > 0
        g = torch.where(support, torch.pow(torch.where(support, p, 1.0), 2.0 - alpha), 0.0)
        g_sum = g.sum(dim=dim, keepdim=True)
        g_hat = g / torch.where(g_sum > 0, g_sum, 1.0)
        dx = g * dp - g_hat * (g * dp).sum(dim=dim, keepdim=True)
        d_alpha = None
        if ctx.needs_input_grad[1]:
            am1 = alpha - 1.0
            plogp = torch.where(support, p * torch.log(torch.where(support, p, 1.0)), 0.0)
            neg_h = plogp.sum(dim=dim, keepdim=True)
            dp_dalpha = (p - g_hat) / am1**2 - (plogp - g_hat * neg_h) / am1
            d_alpha = _sum_to_param((dp * dp_dalpha).sum(dim=dim, keepdim=True), alpha)
        return dx, d_alpha, None


def entmax(x: Tensor, alpha: Param = 1.5, dim: int = -1) -> Tensor:
    """α-entmax: p_j = [(α−1) x_j − τ]_+^{1/(α−1)}, τ normalising the row (α=2 sparsemax, α→1 softmax).

    Exact (sort-based) for α = 1.5 and 2; fp32-accurate bisection otherwise. `alpha` may be a tensor
    broadcastable against the rows (per head), with a gradient. α = 1 exactly gives softmax.
    """
    dt = compute_dtype(x.dtype)
    xf = x.to(dt)
    if not isinstance(alpha, Tensor):
        if not math.isfinite(alpha) or alpha < 1.0:
            raise ValueError(f"entmax needs alpha >= 1, got {alpha}")
        if alpha == 1.0:
            return _softmax_fp(xf, dim).to(x.dtype)
        return _Entmax.apply(xf, torch.tensor(float(alpha), dtype=dt, device=x.device), dim).to(x.dtype)
    a = alpha.to(dt)
    if bool((a < 1.0).any()) or not bool(torch.isfinite(a).all()):
        raise ValueError("entmax needs every alpha >= 1")
    while a.dim() < xf.dim():
        a = a.unsqueeze(0)
    is_one = a == 1.0
    if not bool(is_one.any()):
        return _Entmax.apply(xf, a, dim).to(x.dtype)
    # Rows whose α is exactly 1 are softmax rows; the others go through entmax with a stand-in α.
    p = _Entmax.apply(xf, torch.where(is_one, 2.0, a), dim)
    return torch.where(is_one, _softmax_fp(xf, dim), p).to(x.dtype)
