"""Triton kernels against attend(impl="reference"), on the GPU when there is one, else in Triton's interpreter
(tests/devices.py)."""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
from devices import ATOL, ATOL_LOOSE, DEVICE, device_name, on_device
from torch.overrides import TorchFunctionMode
from tritons import compile_env

from sharp.models import NORMS, attend
from sharp.models.problem import build_problem
from sharp.models.streamed import StreamStats
from sharp.plugins.triton import attention, tiles
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

host = importlib.import_module(
    "sharp.plugins.triton.attention"
)  # the module (the package exports a function of that name)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy warnings inside the interpreter


def _qkv(b=1, hq=4, hkv=2, lq=21, lk=45, d=16, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g)
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, d, generator=g)
    qs = torch.rand(b, hq, lq, generator=g) + 0.5
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), qs.to(device)


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


def _problem(q, k, v, **kw):
    args = dict(
        norm="softmax",
        causal=False,
        scale=None,
        alpha=1.5,
        ssa_n=1.5,
        ssa_b=1.0,
        ssmax_s=1.0,
        poly=(-0.037, 0.481, -2.3, 4.917, -1.791),
        query_scale=None,
        alibi_slopes=None,
    )
    args.update(kw)
    return build_problem(q, k, v, **args)


def _norm_kwargs(norm, hq, qs, per_head):
    kw = {"norm": norm}
    if norm == "asentmax":
        kw["query_scale"] = qs
    if per_head:
        kw.update(
            alpha=torch.linspace(1.2, 2.0, hq),
            ssa_n=torch.linspace(1.0, 2.0, hq),
            ssa_b=torch.linspace(0.5, 1.5, hq),
            ssmax_s=torch.linspace(0.5, 1.5, hq),
            alibi_slopes=torch.tensor([0.5, 0.25, 0.0, 0.0]),
        )
    return on_device(kw, qs.device)


CASES = list(itertools.product(NORMS, [False, True], [(4, 4), (4, 1)], ["prefill", "decode"]))


@pytest.mark.parametrize(("norm", "causal", "heads", "shape"), CASES)
def test_kernels_match_reference(norm, causal, heads, shape):
    """16-key tiles, well below the key lengths: every program walks several tiles (a KV cache: Lq < Lk)."""
    hq, hkv = heads
    lq, lk = (21, 45) if shape == "prefill" else (1, 70)
    q, k, v, qs = _qkv(hq=hq, hkv=hkv, lq=lq, lk=lk, seed=len(norm) + causal)
    kw = _norm_kwargs(norm, hq, qs, per_head=causal)  # alternate scalar and per-head params, ALiBi
    o_ref, h_ref = attend(q, k, v, causal=causal, return_entropy=True, **kw)
    o_tri, h_tri = attend(q, k, v, causal=causal, return_entropy=True, impl="triton", block_size=16, **kw)
    torch.testing.assert_close(o_tri, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(h_tri, h_ref, atol=ATOL, rtol=0)


def test_decode_packs_a_kv_heads_queries_into_one_program():
    """Decode (Lq ≤ 16) launches one program per KV head and split, its rows the GROUP × Lq queries that share the KV
    head (each key and value read once for all of them), with whole key blocks per split and at least TARGET_PROGRAMS
    programs; prefill keeps a program per query block and head."""
    from sharp.plugins.triton.attention import TARGET_PROGRAMS, grid

    q = torch.empty(1, 32, 1, 128, device="meta")
    k = torch.empty(1, 8, 32768, 128, device="meta")
    p = _problem(q, k, k)
    cfg = launch_config(p)
    assert cfg.packed and cfg.block_m == 16 and cfg.keys_per_split % cfg.block_n == 0
    x, kv_programs, splits = grid(p, cfg)
    assert (x, kv_programs) == (1, 8) and kv_programs * splits >= TARGET_PROGRAMS
    p5 = _problem(torch.empty(2, 32, 5, 128, device="meta"), k.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1))
    assert launch_config(p5).block_m == 32 and grid(p5, launch_config(p5))[:2] == (1, 16)  # 4 heads × 5 queries
    pre = _problem(torch.empty(1, 32, 100, 128, device="meta"), k, k)
    assert not launch_config(pre).packed and grid(pre, launch_config(pre))[1] == 32


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("lq", [1, 5])
def test_split_k_merge_with_empty_splits(norm, lq):
    """Decode with several key splits of several tiles each, GQA 4:2, a KV cache and per-head parameters: causal
    rows see no key in later splits (fully masked partial rows)."""
    q, k, v, qs = _qkv(hq=4, hkv=2, lq=lq, lk=100, seed=11)
    kw = _norm_kwargs(norm, 4, qs, per_head=True)
    p = _problem(q, k, v, causal=True, **kw)
    o_ref, h_ref = attend(q, k, v, causal=True, return_entropy=True, **kw)
    cfg = launch_config(p, block_size=16, splits=3)
    assert cfg.splits == 3 and cfg.keys_per_split > cfg.block_n  # several tiles per split
    o, h = run_problem(p, block_size=16, splits=3)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm", ["softmax", "ssmax", "ssa", "adaptive"])
@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_negative_row_factors_fold_into_the_query(norm, shape):
    """The kernels fold each row's factor (scale, ssmax's s·log n, SSA's b·scale) into its query's sign so the row
    max is one factor times max q·k; a negative scale or s must still give the reference's attention."""
    q, k, v, _ = _qkv(lq=21 if shape == "prefill" else 1, lk=45, seed=3)
    kw = {"ssmax_s": torch.tensor([-1.0, 0.5, -0.2, 1.0])} if norm == "ssmax" else {}
    scale = 0.7 if norm == "ssmax" else -0.4
    o_ref, h_ref = attend(q, k, v, norm=norm, causal=True, scale=scale, return_entropy=True, **kw)
    o, h = attend(q, k, v, norm=norm, causal=True, scale=scale, return_entropy=True, impl="triton", block_size=16,
                  **on_device(kw, q.device))  # fmt: skip
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_output_without_entropy_is_the_same(norm, shape):
    """A caller that does not ask for the entropy (return_entropy=False) gets the same output; the one-launch
    prefill kernels (softmax family and entmax) then skip the entropy's work (ENTROPY=False) and return none."""
    q, k, v, qs = _qkv(lq=21 if shape == "prefill" else 1, lk=45, seed=4)
    kw = _norm_kwargs(norm, 4, qs, per_head=False)
    o_ref = attend(q, k, v, causal=True, **kw)
    o = attend(q, k, v, causal=True, impl="triton", block_size=16, **kw)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    p = _problem(q, k, v, causal=True, **kw)
    o2, h2 = run_problem(p, block_size=16, entropy=False)
    torch.testing.assert_close(o2, o_ref.float(), atol=ATOL, rtol=0)
    assert (h2 is None) == (shape == "prefill")


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_key_mask_padding_matches_reference(norm, shape):
    """Left-padded batches as serving builds them: row 0 unpadded, row 1 with 7 padding keys, row 2 with 30, so
    its first causal queries see only padding (all-masked rows: zero output, zero entropy), plus a hole in the
    middle of row 0; several tiles and, for decode, several key splits per program."""
    lq, lk = (21, 45) if shape == "prefill" else (1, 70)
    q, k, v, qs = _qkv(b=3, hq=4, hkv=2, lq=lq, lk=lk, seed=7)
    mask = torch.ones(3, lk, dtype=torch.bool, device=DEVICE)
    mask[1, :7] = False
    mask[2, :30] = False
    mask[0, 20:23] = False
    kw = _norm_kwargs(norm, 4, qs, per_head=True)
    o_ref, h_ref = attend(q, k, v, causal=True, key_mask=mask, return_entropy=True, **kw)
    splits = None if shape == "prefill" else 3
    o, h = run_problem(_problem(q, k, v, causal=True, key_mask=mask, **kw), block_size=16, splits=splits)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=0)
    if shape == "prefill":
        assert bool((o[2, :, :6] == 0).all()) and bool((h[2, :, :6] == 0).all())  # rows that see only padding


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.3])
@pytest.mark.parametrize("splits", [None, 3])
def test_entmax_scalar_alpha_fast_paths(alpha, splits):
    """α = 1.5 and 2 take the kernels' exp/log-free power paths (α = 1.3 the general one), fused prefill and
    split-K decode (logits → τ on chip → partial outputs)."""
    lq = 21 if splits is None else 3
    q, k, v, _ = _qkv(hq=4, hkv=2, lq=lq, lk=75, seed=5)
    kw = dict(norm="entmax", causal=True, alpha=alpha, alibi_slopes=torch.tensor([0.5, 0.25, 0.0, 0.1], device=DEVICE))
    o_ref, h_ref = attend(q, k, v, return_entropy=True, **kw)
    stats = StreamStats()
    o, h = run_problem(_problem(q, k, v, **kw), block_size=16, splits=splits, stats=stats)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=0)
    # Halley's step where S'' is bounded (α ≤ 1.5) converges in fewer passes than Newton's (8–9 at these sizes)
    assert 1 <= stats.threshold_passes <= (6 if alpha <= 1.5 else 8)


class _SharpCalls(TorchFunctionMode):
    """Records the torch calls made from sharp's own code (models/, plugins/) while it is on: those that make a tensor
    (ops: on a GPU, each a launch or at least host work), and those that make the host wait for a CUDA device —
    reading a tensor's values, or building a tensor from host data (PyTorch copies that from pageable memory and
    waits for the copy, behind everything already queued)."""

    READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "nonzero"})
    FROM_HOST = frozenset({"tensor", "as_tensor", "from_numpy"})
    OURS = tuple(str(Path(f.__code__.co_filename).parents[n]) for f, n in ((run_problem, 1), (build_problem, 0)))

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.waits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
            frame = frame.f_back
        result = func(*args, **(kwargs or {}))
        if frame is not None and frame.f_code.co_filename.startswith(self.OURS):
            name = getattr(func, "__name__", "")
            where = f"{name} at {Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
            if isinstance(result, torch.Tensor) and name != "__get__":  # an op making a tensor (not an attribute)
                self.ops.append(where)
            if name in self.READS or (name in self.FROM_HOST and not (args and isinstance(args[0], torch.Tensor))):
                self.waits.append(where)
        return result


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("per_head", [False, True], ids=["float-params", "tensor-params"])
@pytest.mark.parametrize("splits", [1, 3], ids=["one-program", "split-k"])
def test_no_host_synchronisation_inside_a_call(norm, per_head, splits):
    """Given a validated problem (build_problem reads parameter values once), the kernels' host code never makes the
    host wait for the device without `stats` — what CUDA-graph capture and overlapping launches need: no value read
    back, and no parameter copied from host memory per call (float parameters once were, on every launch)."""
    q, k, v, qs = _qkv(hq=4, hkv=2, lq=3, lk=70, seed=2)
    kw = _norm_kwargs(norm, 4, qs, per_head=per_head)
    p = _problem(q, k, v, causal=True, **kw)
    o_ref = attend(q, k, v, causal=True, **kw)
    run_problem(p, block_size=16, splits=splits)  # the first call may copy constants to the device, once
    with _SharpCalls() as calls:
        o, _ = run_problem(p, block_size=16, splits=splits)
    assert calls.waits == []
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("norm", "bound"), [("softmax", 12), ("ssmax", 15), ("ssa", 18), ("adaptive", 32)])
def test_split_k_decode_merges_on_the_device(norm, bound):
    """Split-K decode of the softmax family merges its splits' states in one kernel launch: the tensor ops of a call
    (each a launch or host work on a GPU, where this path was host-bound: 0.46–0.94 ms a call on an H200) are its
    buffers and parameters — softmax 12, ssmax 15, SSA 18, adaptive 32 (β's polynomial by tensor ops), where the
    merge by tensor ops made them 37, 40, 43 and 78."""
    q, k, v, qs = _qkv(hq=4, hkv=2, lq=1, lk=70, seed=2)
    kw = _norm_kwargs(norm, 4, qs, per_head=True)
    p = _problem(q, k, v, causal=True, **kw)
    run_problem(p, block_size=16, splits=3)
    with _SharpCalls() as calls:
        o, h = run_problem(p, block_size=16, splits=3)
    assert len(calls.ops) <= bound, calls.ops
    o_ref, h_ref = attend(q, k, v, causal=True, return_entropy=True, **kw)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=0)


def test_decode_config_splits_keys_to_fill_the_gpu():
    q, k, v, _ = _qkv(b=1, hq=2, hkv=2, lq=1, lk=4096)
    cfg = launch_config(_problem(q, k, v), block_size=64)
    assert cfg.block_m == 16 and cfg.splits > 16  # one sequence, two heads: the keys are split
    assert cfg.splits * cfg.keys_per_split >= 4096


@pytest.mark.parametrize("norm", NORMS)
def test_large_logits_exact_inputs(norm):
    """|z| up to ~9e3 with integer q, k so every implementation sees bit-identical logits."""
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-3, 4, (1, 2, 9, 16), generator=g).float().to(DEVICE)
    k = torch.randint(-3, 4, (1, 2, 33, 16), generator=g).float().to(DEVICE)
    v = torch.randn(1, 2, 33, 16, generator=g).to(DEVICE)
    kw = dict(
        norm=norm,
        scale=64.0,
        causal=True,
        return_entropy=True,
        query_scale=torch.ones(1, 2, 9, device=DEVICE) if norm == "asentmax" else None,
    )
    o_ref, h_ref = attend(q, k, v, **kw)
    o_tri, h_tri = attend(q, k, v, impl="triton", block_size=16, **kw)  # new maxima arrive in later tiles
    assert torch.isfinite(o_tri).all() and torch.isfinite(h_tri).all()
    torch.testing.assert_close(o_tri, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(h_tri, h_ref, atol=ATOL, rtol=0)


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
    q, k, v, qs = _qkv(b=2, hq=4, hkv=2, lq=70, lk=70, d=16, seed=5)
    mask = torch.ones(2, 70, dtype=torch.bool, device=DEVICE)
    mask[1, :9] = False
    alpha = torch.tensor([1.25, 1.5, 1.75, 3.0], dtype=torch.float64, device=DEVICE)
    q, k, v = (t.to(dtype) for t in (q * 3.0, k, v))
    kw = dict(norm=norm, causal=True, key_mask=mask, return_entropy=True)
    o_ref, h_ref = attend(q.double(), k.double(), v.double(), alpha=alpha,
                          query_scale=qs.double() if norm == "asentmax" else None, **kw)  # fmt: skip
    kw = dict(kw, alpha=alpha.float(), query_scale=qs if norm == "asentmax" else None)
    kw.pop("return_entropy")
    out, ent = run_problem(_problem(q, k, v, **kw), block_size=16)
    o_ref, h_ref = o_ref.float(), h_ref.float()
    out2, ent2 = run_problem(_problem(q, k, v, **kw), block_size=16, entropy=False)  # ENTROPY=False: no log w
    assert ent2 is None and torch.equal(out2, out)
    assert torch.isfinite(out.float()).all() and torch.isfinite(ent).all()
    tol, tol_h = (ATOL, ATOL) if dtype == torch.float32 else (2.5e-3, 5e-4)  # fp16: the half rounding of P
    torch.testing.assert_close(out.float(), o_ref, atol=tol, rtol=0)
    torch.testing.assert_close(ent, h_ref, atol=tol_h, rtol=0)


@pytest.mark.parametrize("d", [24, 80])
def test_head_dims_that_are_not_powers_of_two(d):
    q, k, v, _ = _qkv(hq=2, hkv=2, lq=9, lk=20, d=d)
    for norm in ("ssmax", "entmax"):
        o_ref = attend(q, k, v, norm=norm, causal=True)
        torch.testing.assert_close(attention(q, k, v, norm=norm, causal=True), o_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    q, k, v, _ = _qkv(dtype=dtype)
    out, ent = attention(q, k, v, norm="entmax", causal=True, return_entropy=True)
    assert out.dtype == dtype and ent.dtype == torch.float32
    ref = attend(q.float(), k.float(), v.float(), norm="entmax", causal=True)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=0)


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_entmax_pass_count_and_block_skipping(alpha):
    q, k, v, _ = _qkv(hq=2, hkv=2, lq=48, lk=128, seed=3)
    slopes = torch.tensor([2.0, 1.0], device=DEVICE)
    p = _problem(q, k, v, norm="entmax", causal=True, alpha=alpha, alibi_slopes=slopes)
    stats = StreamStats()
    out, ent = run_problem(p, block_size=16, stats=stats)
    o_ref, h_ref = attend(q, k, v, norm="entmax", causal=True, alpha=alpha, alibi_slopes=slopes, return_entropy=True)
    torch.testing.assert_close(out, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, h_ref, atol=ATOL, rtol=0)
    assert stats.threshold_passes <= 8
    assert stats.block_sparsity > 0.3


def test_empty_keys_and_errors(monkeypatch):
    q, _, _, _ = _qkv(lq=2)
    k = torch.zeros(1, 2, 0, 16, device=DEVICE)
    assert (attention(q, k, k, norm="ssa") == 0).all()
    q, k, v, _ = _qkv(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="forward-only"):
        attend(q.clone().requires_grad_(), k, v, impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        attention(q, k, v, norm="softmax")


@pytest.mark.compile
@pytest.mark.skipif(sys.platform != "linux", reason="the CUDA backend's ptxas ships for Linux")
def test_ahead_of_time_compile_to_ptx_for_sm90(tmp_path):
    """No GPU needed: the TensorRT plugin is built from exactly these PTX/CUBIN files."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharp.plugins.triton.aot",
            "--kernels",
            "torch",
            "--arch",
            "90",
            "--out",
            str(tmp_path),
            "--dtype",
            "bf16",
            "fp16",
            "--head-dim",
            "64",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {m["kernel"] for m in manifest} == {"softmax_family", "entmax"}
    from sharp.plugins.triton.aot import default_ptx_version

    want = "{}.{}".format(*divmod(default_ptx_version(90), 10))
    for m in manifest:
        ptx = (tmp_path / f"{m['variant']}.ptx").read_text()
        assert ".target sm_90" in ptx and f".entry {m['entry']}(" in ptx
        assert f".version {want}\n" in ptx and m["ptx_version"] == want  # ≤ 9.0: what driver 580 loads
        launch = m["launch"]
        assert launch["scratch_bytes"] == 0  # TensorRT passes null for Triton's hidden scratch pointers
        assert launch["block"] == [32 * m["num_warps"], 1, 1]
        assert launch["shared_opt_in"] == (launch["shared_bytes"] > 48 * 1024)
        # one parameter per argument, a tuple argument (a list of types) flattened into one per element
        kinds = [k for k in m["signature"].values() if k != "constexpr"]
        params = sum(len(k) if isinstance(k, list) else 1 for k in kinds)
        assert any(isinstance(k, list) for k in kinds)  # the torch path's kernels take stride and size tuples
        assert launch["arguments"][params:] == ["global_scratch", "profile_scratch"]
        assert len(set(launch["arguments"])) == len(launch["arguments"]) == params + 2
        # the PTX entry takes exactly these parameters, in this order (Triton names them <entry>_param_<i>)
        assert f"{m['entry']}_param_{len(launch['arguments']) - 1}" in ptx
        assert f"{m['entry']}_param_{len(launch['arguments'])}" not in ptx
        assert (tmp_path / f"{m['variant']}.cubin").stat().st_size > 1000
    _launch_through_the_manifest(manifest)


ROOT = Path(__file__).resolve().parents[1]


def _triton_floor() -> str:
    """The oldest Triton the kernels extra admits (pyproject: triton>=X)."""
    return re.search(r'^kernels = \["triton>=([0-9.]+)"\]', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


@pytest.mark.compile
@pytest.mark.skipif(sys.platform != "linux", reason="the CUDA backend's ptxas ships for Linux")
@pytest.mark.parametrize("which", ["newest", "oldest"])
def test_every_kernel_compiles_for_sm90_under_the_jit_specialisations(which, tmp_path):
    """What a GPU compiles: every torch-path launch (prefill, split-K and paged decode, merge) with the values the
    JIT specialises on (divisible by 16, unit constants) and every TensorRT entry point, under the newest Triton
    (the venv's) and the oldest pyproject admits; the PTX ISA is the highest that Triton's ptxas writes, ≤ 9.0."""
    env = compile_env(which)
    args = ["--kernels", "all", "--arch", "90", "--dtype", "bf16", "--head-dim", "128", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "sharp.plugins.triton.aot", *args], capture_output=True, text=True,
                          env=env, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines() if "FAILED" in line)[-3000:]
    _, version, _, _, ptx = proc.stdout.splitlines()[0].replace(",", "").split()[:5]
    if which == "oldest":
        assert version.startswith(_triton_floor()), (version, _triton_floor())
    else:
        assert version == importlib.metadata.version("triton")
    from sharp.plugins.triton import kernels, paged

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {m["kernel"] for m in manifest} == set(kernels.KERNELS) | set(paged.KERNELS)
    assert {m["specialisation"] for m in manifest} == {"aligned", "plain", "jit"}
    for m in manifest:
        assert m["ptx_version"] == ptx and f".version {ptx}\n" in (tmp_path / f"{m['variant']}.ptx").read_text()
    assert float(ptx) <= 9.0 and (version < "3.9" or ptx == "9.0")  # 3.9's ptxas writes 9.4: capped
    jit = {m["variant"]: m for m in manifest}["entmax_threshold_bf16_d128_fast0_jit"]
    assert jit["constexprs"]["LQ"] == 1 and {"LK", "ROWS", "H", "U"} <= set(jit["divisible_by_16"])


def _grid(launch: dict, sizes: dict) -> tuple[int, ...]:
    ceil_div = lambda a, b: -(-a // b)
    return tuple(int(eval(expr, {"__builtins__": {}}, {"ceil_div": ceil_div, **sizes})) for expr in launch["grid"])


def _launch_through_the_manifest(manifest: list[dict]) -> None:
    """What a plugin does with the manifest alone — arguments by name in its order, the grid from its expressions,
    the constexprs it records — for the fp16 prefill variants, in the interpreter, against the reference."""
    from sharp.plugins.triton import kernels

    b, hq, hkv, lq, lk, d = 2, 4, 2, 100, 100, 64  # 2 query blocks × 2 key tiles of 64 per program
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, h, n, d, generator=g).half().to(DEVICE) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    bh, dummy = b * hq, torch.zeros(1, device=DEVICE)
    cases = {
        "softmax_family_fp16_d64_causal_entropy_finalize_logn_with_v": ("ssmax", dummy),
        "softmax_family_fp16_d64_causal_entropy_finalize_ssa_with_v": ("ssa", dummy),
        "softmax_family_fp16_d64_adaptive_causal_entropy_finalize_with_v": ("adaptive", dummy),
        "entmax_fp16_d64_causal_entropy_exact_d": ("entmax", dummy),
    }
    entries = {m["variant"]: m for m in manifest}
    for variant, (norm, rowf) in cases.items():
        m = entries[variant]
        out, ent = torch.zeros(bh, lq, d, dtype=torch.float16, device=DEVICE), torch.zeros(bh, lq, device=DEVICE)
        kw = {"ssa_n": 1.5, "ssa_b": 1.0} if norm == "ssa" else {}
        if norm == "ssmax":  # s·log n, n counted in the kernel
            kw = {"ssmax_s": 1.3}
        poly = torch.tensor((-0.037, 0.481, -2.3, 4.917, -1.791), device=DEVICE)
        values = dict(
            Q=q, K=k, V=v, ROWF=rowf, SSMAX_S=torch.full((hq,), 1.3, device=DEVICE),
            SSA_N=torch.full((hq,), 1.5, device=DEVICE), SSA_B=torch.full((hq,), 1.0, device=DEVICE), POLY=poly,
            SLOPES=dummy, LAMBDA=dummy, KMASK=dummy, M_OUT=dummy, L_OUT=dummy, KP_OUT=dummy, ACC_OUT=dummy,
            OUT=out, ENT_OUT=ent, H=hq, GROUP=hq // hkv, LQ=lq, LK=lk, D=d, BH=bh, scale=d**-0.5,
            keys_per_split=128, smb=lk, NPOLY=poly.numel(), beta_threshold=0.5,
            ALPHA=torch.full((hq,), 1.5, device=DEVICE), COUNTS=dummy, max_passes=30,
            tol=4 * torch.finfo(torch.float32).eps,
        )  # fmt: skip
        for name, t in (("q", q), ("k", k), ("v", v)):
            values.update(zip((f"s{name}b", f"s{name}h", f"s{name}{'m' if name == 'q' else 'n'}", f"s{name}d"),
                              t.stride(), strict=True))  # fmt: skip
        launch = m["launch"]
        flat = iter([values[a] for a in launch["arguments"] if a not in ("global_scratch", "profile_scratch")])
        # the entry's parameters in order; Triton's launcher takes a tuple argument (a list in the signature) whole
        args = [tuple(next(flat) for _ in kind) if isinstance(kind, list) else next(flat)
                for kind in m["signature"].values() if kind != "constexpr"]  # fmt: skip
        assert next(flat, None) is None
        kernels.KERNELS[m["kernel"]][_grid(launch, values)](*args, **m["constexprs"])
        o_ref, h_ref = attend(
            q.float(), k.float(), v.float(), norm=norm, causal=True, return_entropy=True,
            poly=tuple(poly.tolist()), **kw,
        )  # fmt: skip
        o = out.view(b, hq, lq, d).float()
        torch.testing.assert_close(o, o_ref, atol=2e-3, rtol=0, msg=variant)
        torch.testing.assert_close(ent.view(b, hq, lq), h_ref, atol=1e-3, rtol=0, msg=variant)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the refusal on a machine without CUDA")
def test_the_gpu_selection_refuses_without_a_gpu():
    """`make test-gpu` cannot do its job without CUDA: it exits non-zero naming why, never "0 selected"."""
    proc = subprocess.run(["make", "-s", "test-gpu", f"GPU_PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode != 0 and "no CUDA device is visible to torch" in proc.stderr


IN_PROCESS_SMOKE = pytest.mark.skipif(
    not host.interpreting(), reason="--smoke in this process needs Triton's interpreter, chosen before triton was "
    "imported (on a GPU the benchmark's real run is `sharp-bench kernels`; the CLI's own smoke run is tested apart)"
)  # fmt: skip


@IN_PROCESS_SMOKE
def test_kernel_benchmark_runs_end_to_end_in_smoke_mode(capsys):
    """The GPU benchmark's whole pipeline at toy sizes (numbers meaningless; nothing written)."""
    from sharp.benchmarks.kernels import run

    assert run(["--smoke", "--check", "--norms", "softmax", "entmax"]) == 0
    out = capsys.readouterr().out
    assert "SDPA-flash softmax" in out and "entmax (NAPE)" in out and "Decode (Lq = 1" in out
    assert "softmax (paged, 16-key pages)" in out and "FlexAttention softmax" in out
    # --check: each sharp kernel row carries its error against the fp32 streamed reference — the entropy (fp32 on
    # chip) to float error, the bf16 output to bf16 rounding (half an ulp of values up to ~4 is 0.016)
    checked = [line.split(" | ")[-1].rstrip(" |") for line in out.splitlines()
               if line.startswith("| 40 |") and ("| softmax |" in line or "| entmax" in line)]  # fmt: skip
    assert len(checked) == 6
    for cell in checked:
        d_out, d_h = (float(x) for x in cell.split(" / "))
        assert d_out < 3e-2 and d_h < ATOL, cell


@pytest.mark.parametrize("norm", ["softmax", "ssmax", "ssa"])
@pytest.mark.parametrize("causal", [False, True])
def test_flex_attention_baseline_computes_the_same_norm(norm, causal):
    """The benchmark's FlexAttention baseline is the same function as sharp's norm (default parameters)."""
    from sharp.benchmarks import kernels as bench
    from sharp.benchmarks.kernels import _flex_runner

    runs = []
    for length in (40, 24, 40):  # one score_mod per norm for the run: a length's parameter must not stick
        q, k, v, _ = _qkv(hq=2, hkv=2, lq=length, lk=length, seed=length)
        want = attend(q, k, v, norm=norm, causal=causal, ssa_n=1.5, ssa_b=1.0, ssmax_s=1.0)
        runs.append((_flex_runner(q, k, v, norm, causal, gpu=DEVICE.type == "cuda"), want))
    for run, want in runs[::-1]:
        torch.testing.assert_close(run(), want, atol=ATOL, rtol=0)
    assert sum(key[:2] == (norm, causal) for key in bench._FLEX_MODS) == 1


@IN_PROCESS_SMOKE
def test_kernel_benchmark_reports_a_baseline_that_cannot_run(capsys, monkeypatch):
    """A baseline that fails (FlexAttention out of memory, a compile error) becomes a row with the reason; the run
    goes on and writes its table."""
    from sharp.benchmarks import kernels as bench

    real = bench._flex_runner

    def failing(q, k, v, norm, causal, gpu):
        if norm == "ssa":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
        return real(q, k, v, norm, causal, gpu)

    monkeypatch.setattr(bench, "_flex_runner", failing)
    assert bench.run(["--smoke", "--norms", "softmax", "ssa"]) == 0
    out = capsys.readouterr().out
    reasons = [line for line in out.splitlines() if "| FlexAttention ssa |" in line]
    assert len(reasons) == 2 and all("not run: OutOfMemoryError: CUDA out of memory" in r for r in reasons)
    assert out.count("| FlexAttention softmax |") == 2 and "Decode (Lq = 1" in out


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
    split_k = run_problem(_problem(q, k, v, norm="entmax", causal=True, alpha=2.5), block_size=16, splits=3)
    runs = {impl: attend(q, k, v, impl=impl, block_size=16, **kw) for impl in ("streamed", "triton")}
    for impl, (o, h) in (runs | {"triton split-K": split_k}).items():
        torch.testing.assert_close(o.double(), o_ref, atol=5e-5, rtol=0, msg=lambda m, impl=impl: f"{impl}: {m}")
        torch.testing.assert_close(h.double(), h_ref, atol=5e-5, rtol=0, msg=lambda m, impl=impl: f"{impl}: {m}")


@pytest.mark.parametrize("norm", ["ssa", "adaptive", "entmax"])
def test_every_prefill_tile_computes_the_same_attention(norm):
    """Each tile the tuner may pick (up to 128 × 128) over several key tiles: causal, a padding mask, GQA."""
    q, k, v, qs = _qkv(b=2, hq=4, hkv=2, lq=150, lk=150, d=16, seed=4)
    mask = torch.ones(2, 150, dtype=torch.bool, device=DEVICE)
    mask[1, :37] = False  # a left-padded row
    kw = dict(_norm_kwargs(norm, 4, qs, per_head=True), causal=True, key_mask=mask)
    o_ref, h_ref = attend(q, k, v, return_entropy=True, **kw)
    p = _problem(q, k, v, **kw)
    for tile in tiles.PREFILL_TILES:
        cfg = launch_config(p, tile=tile)
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.splits) == (tile.block_m, tile.block_n, tile.num_warps, 1)
        o, h = host._run(p, cfg, None)
        torch.testing.assert_close(o, o_ref, atol=ATOL_LOOSE, rtol=0, msg=str(tile))
        torch.testing.assert_close(h, h_ref, atol=ATOL_LOOSE, rtol=0, msg=str(tile))


def test_prefill_tiles_are_tuned_once_per_problem_class(monkeypatch):
    """With tuning on (forced in the interpreter) the first prefill of a class times every candidate, later ones of
    the class reuse the choice, a new length class tunes again, and decode (split keys) is never tuned."""
    from sharp.plugins.triton.tiles import Tile

    monkeypatch.setenv("SHARP_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(tiles, "PREFILL_TILES", (Tile(16, 16), Tile(32, 32, 8)))
    monkeypatch.setattr(tiles, "_TUNED", {})
    timed = []
    time_ms = tiles._time_ms
    monkeypatch.setattr(tiles, "_time_ms", lambda fn, dev: timed.append(1) or time_ms(fn, dev))
    for lq in (40, 50, 100):  # 40 and 50 share a length class (33–64); 100 does not
        q, k, v, _ = _qkv(lq=lq, lk=lq, seed=lq)
        o, h = attend(q, k, v, norm="ssa", causal=True, impl="triton", return_entropy=True)
        o_ref, h_ref = attend(q, k, v, norm="ssa", causal=True, return_entropy=True)
        torch.testing.assert_close(o, o_ref, atol=ATOL_LOOSE, rtol=0)
        torch.testing.assert_close(h, h_ref, atol=ATOL_LOOSE, rtol=0)
    assert len(timed) == 4 and len(tiles._TUNED) == 2
    assert set(tiles._TUNED.values()) <= set(tiles.PREFILL_TILES)
    q, k, v, _ = _qkv(lq=1, lk=300)
    attend(q, k, v, norm="ssa", impl="triton")
    assert len(timed) == 4  # decode: split-K, not tuned


def test_tuned_tiles_persist_on_disk_per_gpu_triton_and_class(monkeypatch, tmp_path):
    """A restarted server tunes nothing it tuned before: the choice is stored per (GPU, Triton version, problem
    class) in the tile cache and read back without timing anything; a corrupt file or a tile no longer offered
    is ignored (tuned again), and SHARP_TILE_CACHE=0 keeps tiles in the process only."""
    import triton

    from sharp.plugins.triton.tiles import Tile

    cache = tmp_path / "tiles.json"
    monkeypatch.setenv("SHARP_TRITON_AUTOTUNE", "1")
    monkeypatch.setenv("SHARP_TILE_CACHE", str(cache))
    monkeypatch.setattr(tiles, "PREFILL_TILES", (Tile(16, 16), Tile(32, 32, 8)))
    timed = []
    time_ms = tiles._time_ms
    monkeypatch.setattr(tiles, "_time_ms", lambda fn, dev: timed.append(1) or time_ms(fn, dev))
    q, k, v, _ = _qkv(lq=40, lk=40)

    def prefill() -> Tile:
        monkeypatch.setattr(tiles, "_TUNED", {})  # a new process
        attend(q, k, v, norm="ssa", causal=True, impl="triton")
        (tile,) = tiles._TUNED.values()
        return tile

    first = prefill()
    assert len(timed) == 2
    (key, fields), *more = json.loads(cache.read_text()).items()
    assert not more and json.loads(key)[:2] == [device_name(), triton.__version__] and "ssa" in json.loads(key)[2]
    assert Tile(*fields) == first
    assert prefill() == first and len(timed) == 2  # read back, nothing timed
    cache.write_text("{not json")
    prefill()
    assert len(timed) == 4 and json.loads(cache.read_text())  # tuned again, rewritten
    cache.write_text(json.dumps({key: [64, 64, 4, 3]}))  # a tile this build does not offer
    prefill()
    assert len(timed) == 6
    monkeypatch.setenv("SHARP_TILE_CACHE", "0")
    cache.unlink()
    prefill()
    assert len(timed) == 8 and not cache.exists()


def test_the_tuner_skips_tiles_that_do_not_fit_and_keeps_the_fastest(monkeypatch):
    """Which tile wins is the timer's call; a tile the device cannot hold (OutOfResources at compile) is skipped.
    The runs here are a stand-in for kernel launches: the real ones are timed only on a GPU."""
    from triton.runtime.errors import OutOfResources

    from sharp.plugins.triton.tiles import Tile, tuned_tile

    cands = (Tile(64, 64), Tile(128, 128, 8), Tile(128, 64, 8))
    monkeypatch.setattr(tiles, "PREFILL_TILES", cands)
    monkeypatch.setattr(tiles, "_TUNED", {})
    cost = {cands[0]: 3.0, cands[2]: 1.0}
    monkeypatch.setattr(tiles, "_time_ms", lambda fn, dev: fn() or cost[current[0]])
    current = [None]

    def run_with(tile):
        current[0] = tile
        if tile == cands[1]:
            raise OutOfResources(300_000, 232_448, "shared memory")

    q, k, v, _ = _qkv(lq=40, lk=40)
    p = _problem(q, k, v)
    assert tuned_tile(host.tile_class(p), p.q.device, run_with) == cands[2]
    monkeypatch.setattr(tiles, "PREFILL_TILES", (cands[1],))
    monkeypatch.setattr(tiles, "_TUNED", {})
    with pytest.raises(RuntimeError, match="no prefill tile"):
        tuned_tile(host.tile_class(p), p.q.device, run_with)


@pytest.mark.parametrize("norm", ["ssa", "entmax"])
def test_a_model_step_without_entropy_gives_the_same_logits(norm):
    """SharpLM.step(return_entropy=False) carries the choice down to the kernels (the torch backend's step when no
    client asks for entropies); the logits are those of the step that returns them."""
    from sharp.models import ModelConfig, SharpLM

    torch.manual_seed(0)
    model = SharpLM(ModelConfig(dim=32, layers=2, heads=4, norm=norm, context_length=64)).eval().to(DEVICE)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 20), device=DEVICE)
    with torch.no_grad():
        ref = model.step(ids, return_entropy=True, impl="reference")
        out = model.step(ids, return_entropy=False, impl="triton")
    assert out.entropy is None and ref.entropy is not None
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)


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
    p = _problem(q, k, v, norm="entmax", causal=True, alpha=alpha)
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
    p = _problem(4.0 * q, k, v, norm="entmax", causal=True, alpha=1.5)
    stats = StreamStats()
    out, _ = run_problem(p, block_size=64, stats=stats)
    ref = attend(4.0 * q.double(), k.double(), v.double(), norm="entmax", causal=True, alpha=1.5)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)
    if DEVICE.type == "cpu":
        assert sum(stats.program_threshold_passes) <= 43, stats.program_threshold_passes


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU every half-precision test runs these paths")
@pytest.mark.parametrize("norm", ["softmax", "adaptive", "entmax"])
def test_half_precision_column_partials_in_the_interpreter(monkeypatch, norm):
    """The half-precision prefill's row sums as (rows, 8) column partials (MMA_SUMS: Λ and entmax's Σ w from P·e₀,
    K₂ folded into the columns), run in the interpreter's fp16 dots — off CUDA the host otherwise upcasts to fp32
    and takes row vectors. Output and entropy agree with the float64 reference as closely as fp16's P allows."""
    monkeypatch.setattr(host, "dot_f32", lambda t: t.dtype == torch.float32)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 150, 64, generator=gen).to(torch.float16) for _ in range(3))
    out, ent = attend(q, k, v, norm=norm, causal=True, impl="triton", block_size=64, return_entropy=True)
    ref, ref_ent = attend(q.double(), k.double(), v.double(), norm=norm, causal=True, return_entropy=True)
    assert (out.double() - ref).abs().max() < 2e-3
    assert (ent.double() - ref_ent).abs().max() < 1e-3


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
    p = _problem(*(t.to(DEVICE, dtype) for t in (q, k, v)), norm="entmax", causal=True, alpha=1.25)
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


HALF_TYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])  # no bf16 dot in the interpreter


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize(
    ("norm", "per_head"),
    [("softmax", False), ("ssmax", False), ("ssa", False), ("adaptive", False), ("entmax", False),
     ("entmax", True), ("asentmax", False)],
)  # fmt: skip
def test_half_prefill_keeps_its_row_sums_on_the_tensor_cores(norm, per_head, dtype, monkeypatch):
    """Half-precision prefill as a GPU runs it (DOT_F32 off, in the interpreter too): the softmax family's Λ from the
    P·e₀ product and K₂ from (rows, 16) column partials folded by FFMA; entmax's threshold sums folded likewise (in
    its sweeps of twice the keys), its Z from W·e₀ — every tile the tuner may pick (1 to 8 column groups), causal, a
    padding mask, GQA, logits large enough that the row max moves across tiles; entmax at α = 1.5 and per head
    (with ALiBi). Output and entropy within the half rounding of p (what P·V sees) of the fp32 reference on the
    same half inputs."""
    monkeypatch.setattr(host, "dot_f32", lambda t: t.dtype == torch.float32)
    q, k, v, qs = _qkv(b=2, hq=4, hkv=2, lq=150, lk=150, d=16, seed=9)
    q = q * 2.5  # logits of a few units: each row's max and weights move from tile to tile
    mask = torch.ones(2, 150, dtype=torch.bool, device=DEVICE)
    mask[1, :37] = False
    kw = dict(_norm_kwargs(norm, 4, qs, per_head=per_head), causal=True, key_mask=mask)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    o_ref, h_ref = attend(q.float(), k.float(), v.float(), return_entropy=True, **kw)
    assert h_ref.std() > 0.3  # sharp and diffuse rows alike
    p = _problem(q, k, v, **kw)
    tol, tol_h = (2.5e-3, 5e-4) if dtype == torch.float16 else (2e-2, 4e-3)  # measured fp16: 1.0e-3, 1.2e-4
    for tile in tiles.PREFILL_TILES:
        cfg = launch_config(p, tile=tile)
        assert not cfg.dot_f32
        stats = StreamStats()
        o, h = host._run(p, cfg, stats)
        if p.family.name == "ENTMAX":  # the folded derivatives steer the search as the row sums did
            assert stats.threshold_passes <= (5 if per_head else 3), (tile, stats.threshold_passes)
        torch.testing.assert_close(o.float(), o_ref, atol=tol, rtol=0, msg=str(tile))
        torch.testing.assert_close(h, h_ref, atol=tol_h, rtol=0, msg=str(tile))
        o2, _ = host._run(p, cfg, None, entropy=False)
        torch.testing.assert_close(o2.float(), o_ref, atol=tol, rtol=0, msg=str(tile))
