"""`attend`: the reference against torch SDPA and explicit math; streamed against reference (docs/attention.md)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from sharp.models import NORMS, attend, entmax, entropy, softmax
from sharp.models import streamed as streamed_mod
from sharp.models.problem import AttentionProblem, build_problem
from sharp.models.streamed import StreamStats, streamed_attention


def _qkv(b=2, hq=4, hkv=2, lq=19, lk=37, d=16, seed=0, dtype=torch.float32, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g) * spread
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, d, generator=g)
    qs = torch.rand(b, hq, lq, generator=g) + 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype), qs


def _kwargs(norm: str, hq: int, qs: torch.Tensor, per_head: bool) -> dict:
    kw: dict = {"norm": norm}
    if norm == "asentmax":
        kw["query_scale"] = qs
    if per_head:
        kw.update(
            alpha=torch.linspace(1.2, 2.0, hq),
            ssa_n=torch.linspace(1.0, 2.0, hq),
            ssa_b=torch.linspace(0.5, 1.5, hq),
            ssmax_s=torch.linspace(0.5, 1.5, hq),
        )
    return kw


def test_softmax_reference_equals_torch_sdpa_with_gqa_and_causal_alignment():
    q, k, v, _ = _qkv(lq=7, lk=29)
    got = attend(q, k, v, causal=True)
    # explicit causal mask with the KV-cache alignment: query i sits at position Lk − Lq + i
    i = torch.arange(7).view(-1, 1) + (29 - 7)
    mask = torch.arange(29).view(1, -1) <= i
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)


def test_alibi_reference_equals_sdpa_with_explicit_bias():
    q, k, v, _ = _qkv(hkv=4, lq=11, lk=11)
    slopes = torch.tensor([1.0, 0.5, 0.0, 0.0])  # NAPE-style: half the heads have no positional signal
    rel = (torch.arange(11).view(1, -1) - torch.arange(11).view(-1, 1)).float()
    bias = slopes.view(-1, 1, 1) * rel
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(attend(q, k, v, alibi_slopes=slopes), expect, atol=1e-5, rtol=0)


def test_asentmax_is_entmax_of_scaled_logits_and_entropy_is_of_used_weights():
    q, k, v, qs = _qkv(hkv=4, lq=6, lk=6)
    z = (q @ k.transpose(-1, -2)) / math.sqrt(16) * qs[..., None]
    p = entmax(z, 1.5)
    out, ent = attend(q, k, v, norm="asentmax", query_scale=qs, return_entropy=True)
    torch.testing.assert_close(out, p @ v, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, entropy(p), atol=1e-5, rtol=0)
    out_plain, ent_plain = attend(q, k, v, return_entropy=True, scale=0.3)
    p_plain = softmax((q @ k.transpose(-1, -2)) * 0.3)
    torch.testing.assert_close(out_plain, p_plain @ v, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_plain, entropy(p_plain), atol=1e-5, rtol=0)


CASES = list(
    itertools.product(
        NORMS,
        [False, True],  # causal
        [(4, 4), (4, 2), (4, 1)],  # (Hq, Hkv): MHA, GQA, MQA
        [False, True],  # alibi
        [(19, 37), (37, 37), (1, 45)],  # (Lq, Lk): Lq < Lk (cache), square, decode
    )
)


@pytest.mark.parametrize(("norm", "causal", "heads", "alibi", "lengths"), CASES)
def test_streamed_matches_reference(norm, causal, heads, alibi, lengths):
    hq, hkv = heads
    lq, lk = lengths
    q, k, v, qs = _qkv(hq=hq, hkv=hkv, lq=lq, lk=lk, seed=hash((norm, causal, heads, alibi, lengths)) % 1000)
    kw = _kwargs(norm, hq, qs, per_head=alibi)  # vary scalar vs per-head params along with alibi
    kw.update(causal=causal, return_entropy=True)
    if alibi:
        kw["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.0, 0.0])
    o_ref, h_ref = attend(q, k, v, impl="reference", **kw)
    o_str, h_str = attend(q, k, v, impl="streamed", block_size=8, **kw)  # 8 divides neither length
    torch.testing.assert_close(o_str, o_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(h_str, h_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("norm", NORMS)
def test_large_logits_finite_in_fp32_and_streamed_exact_in_fp64(norm):
    """|z| up to ~1e4. In fp32 the logits themselves carry ~1e-3 rounding (BLAS blocking differs between a
    tile and the whole matrix), so fp32 is checked for finiteness and fp64 for the algorithm."""
    q, k, v, qs = _qkv(lq=13, lk=30, spread=300.0)
    kw = _kwargs(norm, 4, qs, per_head=False)
    for impl in ("reference", "streamed"):
        out, ent = attend(q, k, v, impl=impl, return_entropy=True, causal=True, block_size=7, **kw)
        assert torch.isfinite(out).all() and torch.isfinite(ent).all()
    q, k, v = q.double(), k.double(), v.double()
    kw = _kwargs(norm, 4, qs.double(), per_head=False)
    o_ref, h_ref = attend(q, k, v, impl="reference", return_entropy=True, causal=True, **kw)
    o_str, h_str = attend(q, k, v, impl="streamed", block_size=7, return_entropy=True, causal=True, **kw)
    torch.testing.assert_close(o_str, o_ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(h_str, h_ref, atol=1e-9, rtol=0)


@pytest.mark.parametrize("alpha", [1.1, 1.5, 2.0])
def test_streamed_entmax_few_threshold_passes_and_block_skipping(alpha):
    q, k, v, _ = _qkv(b=1, hq=2, hkv=2, lq=64, lk=256, seed=3)
    slopes = torch.tensor([2.0, 1.0])  # strong ALiBi: far blocks fall entirely outside the support
    kw = dict(norm="entmax", causal=True, alpha=alpha, alibi_slopes=slopes)
    problem = build_problem(q, k, v, scale=None, ssa_n=1.5, ssa_b=1.0, ssmax_s=1.0, poly=(), query_scale=None, **kw)
    stats = StreamStats()
    out, ent = streamed_attention(problem, block_size=16, stats=stats)
    o_ref, h_ref = attend(q, k, v, return_entropy=True, **kw)
    torch.testing.assert_close(out, o_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, h_ref, atol=1e-5, rtol=0)
    assert stats.threshold_passes <= 8
    assert stats.block_sparsity > 0.5


def test_streamed_never_builds_more_than_one_tile(monkeypatch):
    """Structural O(n) check: every logits request is at most QUERY_CHUNK × block_size."""
    monkeypatch.setattr(streamed_mod, "QUERY_CHUNK", 16)
    seen: list[tuple[int, int]] = []
    original = AttentionProblem.logits

    def spy(self, q0, q1, k0, k1):
        seen.append((q1 - q0, k1 - k0))
        return original(self, q0, q1, k0, k1)

    monkeypatch.setattr(AttentionProblem, "logits", spy)
    q, k, v, _ = _qkv(lq=70, lk=90)
    for norm in ("softmax", "adaptive", "entmax"):
        attend(q, k, v, norm=norm, impl="streamed", block_size=8)
    assert seen and max(r for r, _ in seen) <= 16 and max(c for _, c in seen) <= 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", ["reference", "streamed"])
def test_half_inputs(dtype, impl):
    q, k, v, _ = _qkv(dtype=dtype)
    out, ent = attend(q, k, v, norm="ssa", impl=impl, return_entropy=True)
    assert out.dtype == dtype and ent.dtype == torch.float32
    expect = attend(q.float(), k.float(), v.float(), norm="ssa")
    torch.testing.assert_close(out.float(), expect, atol=2e-2, rtol=0)


def test_reference_is_differentiable_in_inputs_and_head_params():
    q, k, v, _ = _qkv(hq=2, hkv=2, lq=5, lk=9)
    q.requires_grad_()
    for norm, param in (("entmax", "alpha"), ("ssa", "ssa_n"), ("ssa", "ssa_b"), ("ssmax", "ssmax_s")):
        t = torch.tensor([1.3, 1.7], requires_grad=True)
        attend(q, k, v, norm=norm, causal=True, **{param: t}).square().sum().backward()
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_empty_key_set_gives_zeros():
    q, _, _, _ = _qkv(lq=3)
    k = torch.zeros(2, 2, 0, 16)
    out, ent = attend(q, k, k, return_entropy=True, impl="streamed")
    assert out.shape == (2, 4, 3, 16) and (out == 0).all() and (ent == 0).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"norm": "sparsemax"}, "unknown norm 'sparsemax'; valid: softmax"),
        ({"impl": "cuda"}, "unknown impl 'cuda'; valid: reference, streamed, sdpa, triton"),
        ({"norm": "asentmax"}, "needs query_scale"),
        ({"alpha": torch.ones(3)}, r"alpha must be a float, a scalar tensor or shape \(4,\)"),
        ({"alibi_slopes": torch.ones(2)}, r"alibi_slopes must be \(4,\)"),
        ({"query_scale": torch.ones(4)}, r"query_scale must be \(B, Hq, Lq\)"),
        ({"norm": "entmax", "alpha": 0.5}, "alpha must be finite and >= 1"),
        ({"ssa_n": float("nan")}, "ssa_n must be finite"),
    ],
)
def test_bad_arguments_are_explained(kwargs, message):
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match=message):
        attend(q, k, v, **kwargs)


def test_bad_shapes_are_explained():
    q, k, v, _ = _qkv(hq=3, hkv=2)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        attend(q, k, v)
    q, k, v, _ = _qkv(lq=40, lk=10)
    with pytest.raises(ValueError, match="Lq <= Lk"):
        attend(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"\(B, H, L, D\)"):
        attend(q[0], k, v)
    with pytest.raises(ValueError, match="head dims differ"):
        attend(q, k[..., :8], v)


def test_streamed_refuses_autograd():
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="forward-only"):
        attend(q.requires_grad_(), k, v, impl="streamed")
    with torch.no_grad():
        attend(q, k, v, impl="streamed")


@pytest.mark.parametrize("alpha", [3.0, torch.tensor([1.2, 3.0])])
def test_streamed_entmax_at_large_alpha_relies_on_the_narrowed_bracket(alpha):
    """α > 2 makes S(τ) concave: Newton steps overshoot the root and the safeguard bisects the bracket that
    each pass narrows; with a stale bracket the threshold never converges."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) * 2 for _ in range(3))
    kw = dict(norm="entmax", causal=True, alpha=alpha, return_entropy=True)
    o_ref, h_ref = attend(q, k, v, **kw)
    o_str, h_str = attend(q, k, v, impl="streamed", block_size=16, **kw)
    torch.testing.assert_close(o_str, o_ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(h_str, h_ref, atol=2e-5, rtol=0)


def test_a_third_implementation_registered_by_entry_point_is_taken(tmp_path, monkeypatch):
    """attend(impl=NAME) runs whatever an installed package registers in `sharp.attention_impls` — not only the
    names sharp ships — and lists it among the valid ones."""
    from sharp.models import attention

    (tmp_path / "third_impl.py").write_text(
        "from sharp.models.attention import _reference\n"
        "def run(problem, block_size, with_entropy):\n"
        "    out, ent = _reference(problem, block_size, with_entropy)\n"
        "    return 2 * out, ent\n"
    )
    info = tmp_path / "third_impl-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: third-impl\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sharp.attention_impls]\ndoubled = third_impl:run\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for cached in (attention._installed, attention.registered_impl):
        cached.cache_clear()
    try:
        q, k, v, _ = _qkv()
        assert torch.equal(attend(q, k, v, impl="doubled"), 2 * attend(q, k, v))
        assert "doubled" in attention.available_impls()[2:]
        with pytest.raises(ValueError, match=r"valid: reference, streamed, .*doubled"):
            attend(q, k, v, impl="tripled")
    finally:
        monkeypatch.undo()
        for cached in (attention._installed, attention.registered_impl):
            cached.cache_clear()


def test_sharp_attention_takes_its_attention_function():
    """A layer attends through the function it is given (no mode flag): the library's `attend` by default, the
    op for export (`use_custom_op` swaps it), or any other with the same signature."""
    from sharp.models import ModelConfig
    from sharp.models.layers import SharpAttention, library_attention, op_attention, use_custom_op

    cfg = ModelConfig(dim=32, layers=1, heads=4, norm="ssmax", context_length=16)
    calls = []

    def spy(q, k, v, **kw):
        calls.append(kw["impl"])
        return library_attention(q, k, v, **kw)

    torch.manual_seed(0)
    layer = SharpAttention(cfg, "ssmax", attention=spy)
    x, pos = torch.randn(1, 5, 32), torch.arange(5)[None]
    with torch.no_grad():  # the streamed implementation is forward-only
        out, _, ent = layer(x, pos, impl="streamed")
    assert calls == ["streamed"] and ent.shape == (1, 4, 5)
    plain = SharpAttention(cfg, "ssmax")
    plain.load_state_dict(layer.state_dict())
    assert plain.attention is library_attention
    with torch.no_grad():
        plain_out = plain(x, pos, impl="streamed")[0]
    torch.testing.assert_close(plain_out, out)
    assert use_custom_op(plain) is plain and plain.attention is op_attention
    use_custom_op(plain, on=False)
    assert plain.attention is library_attention


@pytest.mark.parametrize("norm", ["softmax", "ssmax"])
@pytest.mark.parametrize(
    "case", ["causal-square", "causal-cache", "alibi", "key-mask", "query-scale", "half", "not-causal", "hq-groups"]
)
def test_sdpa_equals_the_reference_for_the_row_scaled_norms(norm, case):
    """impl="sdpa" folds the row's factor (SSMax's s·log n, λ, the scale) into the queries and ALiBi into an additive
    mask: the reference's numbers for every feature a row-scaled softmax takes, one fused call or query chunks."""
    lq, lk = {"causal-square": (37, 37), "not-causal": (19, 37)}.get(case, (19, 37))
    dtype = torch.bfloat16 if case == "half" else torch.float32
    q, k, v, qs = _qkv(lq=lq, lk=lk, hkv=1 if case == "hq-groups" else 2, dtype=dtype, spread=2.0)
    kw: dict = {"norm": norm, "causal": case != "not-causal"}
    if norm == "ssmax":
        kw["ssmax_s"] = torch.tensor([0.3, 0.5, 0.9, 1.4])
    if case == "alibi":
        kw["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    if case == "query-scale":
        kw["query_scale"] = qs
    if case == "key-mask":
        mask = torch.ones(2, lk, dtype=torch.bool)
        mask[0, :25] = False  # sequence 0's first 6 queries see no key at all: zeros, as the reference gives
        mask[1, 3:9] = False
        kw["key_mask"] = mask
    ref = attend(q, k, v, impl="reference", **kw)
    out = attend(q, k, v, impl="sdpa", **kw)
    assert out.dtype == q.dtype and not out.isnan().any()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # as streamed against the reference: fp32 sums reordered
    torch.testing.assert_close(out, ref, atol=tol, rtol=0)
    if case == "key-mask":
        assert (out[0, :, :6] == 0).all() and (ref[0, :, :6] == 0).all()


def test_sdpa_chunks_its_queries_when_a_mask_is_needed(monkeypatch):
    """With a mask (here ALiBi), queries go QUERY_CHUNK rows at a time; a chunk's positions are its own."""
    import sharp.models.attention as attention_mod

    monkeypatch.setattr(attention_mod, "QUERY_CHUNK", 5)
    q, k, v, _ = _qkv(lq=23, lk=23)
    kw = dict(norm="ssmax", causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]), ssmax_s=0.7)
    torch.testing.assert_close(attend(q, k, v, impl="sdpa", **kw), attend(q, k, v, **kw), atol=1e-5, rtol=0)


@pytest.mark.parametrize("norm", [n for n in NORMS if n not in ("softmax", "ssmax")])
def test_sdpa_refuses_what_it_cannot_compute(norm):
    """A norm whose transform is not one factor per row (entmax's threshold, SSA's log, adaptive's β of the entropy),
    and the entropy, which SDPA does not give, are refused with what to use instead."""
    from sharp.models.attention import sdpa_runs

    q, k, v, qs = _qkv()
    assert not sdpa_runs(norm) and sdpa_runs("softmax") and sdpa_runs("ssmax")
    with pytest.raises(ValueError, match=r"impl='sdpa' runs softmax, ssmax; .* needs impl='reference' or 'streamed'"):
        attend(q, k, v, norm=norm, query_scale=qs, impl="sdpa")
    with pytest.raises(ValueError, match="gives no entropy"):
        attend(q, k, v, impl="sdpa", return_entropy=True)
