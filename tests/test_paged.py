"""Paged decode (plugins/triton/paged.py) against `attend` on each sequence's gathered keys: shuffled block tables,
partly filled last pages, GQA packed into the rows, several splits, every norm. On the GPU when there is one, else in
Triton's interpreter (tests/devices.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from devices import ATOL, DEVICE, on_device

from sharp.models import attend
from sharp.plugins.triton.paged import paged_decode

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

PAGE = 16
LENGTHS = [37, 5, 64, 1]  # a partly filled last page, one short page, exactly 4 full pages, a single key


def _paged(hkv: int, d: int, lengths: list[int], seed: int = 0):
    """Per-sequence K/V and the same keys scattered over a shuffled page pool."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // PAGE) for n in lengths]
    total = sum(pages_per_seq) + 3  # spare pages: the pool is never exactly full
    order = torch.randperm(total, generator=g)
    k_pages = torch.randn(total, hkv, PAGE, d, generator=g)  # garbage where no key lives
    v_pages = torch.randn(total, hkv, PAGE, d, generator=g)
    table = torch.zeros(len(lengths), max(pages_per_seq), dtype=torch.int32)
    ks, vs, used = [], [], 0
    for b, n in enumerate(lengths):
        k = torch.randn(1, hkv, n, d, generator=g)
        v = torch.randn(1, hkv, n, d, generator=g)
        for j in range(pages_per_seq[b]):
            page = int(order[used])
            used += 1
            table[b, j] = page
            chunk = slice(j * PAGE, min((j + 1) * PAGE, n))
            k_pages[page, :, : chunk.stop - chunk.start] = k[0, :, chunk]
            v_pages[page, :, : chunk.stop - chunk.start] = v[0, :, chunk]
        ks.append(k)
        vs.append(v)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    return *on_device([k_pages, v_pages, table, seq_lens]), on_device(ks), on_device(vs)


def _params(norm: str, hq: int, q: torch.Tensor) -> dict:
    kw = {"alibi_slopes": torch.linspace(0.5, 0.0, hq)}
    if norm in ("entmax", "asentmax"):
        kw.update(alpha=torch.linspace(1.3, 2.0, hq) if hq > 2 else 1.5)
    if norm == "asentmax":
        kw.update(query_scale=torch.rand(q.shape[:3], generator=torch.Generator().manual_seed(3)) + 0.5)
    if norm == "ssa":
        kw.update(ssa_n=torch.linspace(1.0, 2.0, hq), ssa_b=torch.linspace(0.5, 1.5, hq))
    if norm == "ssmax":
        kw.update(ssmax_s=torch.linspace(0.5, 1.5, hq))
    if norm == "adaptive":
        kw.update(poly=(-0.037, 0.481, -2.3, 4.917, -1.791))
    return on_device(kw, q.device)


@pytest.mark.parametrize("norm", ["softmax", "ssmax", "ssa", "adaptive", "entmax", "asentmax"])
@pytest.mark.parametrize(("hq", "hkv", "lq"), [(4, 1, 1), (4, 2, 3), (2, 2, 1)])
@pytest.mark.parametrize("splits", [None, 2])
def test_paged_decode_matches_attend_on_gathered_keys(norm, hq, hkv, lq, splits):
    d = 24  # not a power of two: masked lanes
    lengths = [max(n, lq) for n in LENGTHS]
    k_pages, v_pages, table, seq_lens, ks, vs = _paged(hkv, d, lengths, seed=hq + lq)
    q = torch.randn(len(lengths), hq, lq, d, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    kw = _params(norm, hq, q)
    out, ent = paged_decode(q, k_pages, v_pages, table, seq_lens, norm=norm, splits=splits, **kw)
    for b in range(len(lengths)):
        one = {**kw, "query_scale": kw["query_scale"][b : b + 1]} if "query_scale" in kw else kw
        o_ref, h_ref = attend(q[b : b + 1], ks[b], vs[b], norm=norm, causal=True, return_entropy=True, **one)
        torch.testing.assert_close(out[b : b + 1], o_ref, atol=ATOL, rtol=0, msg=f"sequence {b}")
        torch.testing.assert_close(ent[b : b + 1], h_ref, atol=ATOL, rtol=0, msg=f"sequence {b}")


@pytest.mark.parametrize("norm", ["softmax", "ssmax", "ssa", "adaptive", "entmax", "asentmax"])
def test_paged_decode_defaults_are_attends(norm):
    """Called with no parameters, paged decode computes what `attend` computes with none: both take the registry's
    defaults (adaptive's polynomial included), and per-head parameters may be floats."""
    k_pages, v_pages, table, seq_lens, ks, vs = _paged(2, 16, [37, 20], seed=4)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE) * 2
    lam = {"query_scale": torch.rand(2, 4, 1, device=DEVICE) + 0.5} if norm == "asentmax" else {}
    out, ent = paged_decode(q, k_pages, v_pages, table, seq_lens, norm=norm, **lam)
    for b in range(2):
        one = {"query_scale": lam["query_scale"][b : b + 1]} if lam else {}
        o_ref, h_ref = attend(q[b : b + 1], ks[b], vs[b], norm=norm, causal=True, return_entropy=True, **one)
        torch.testing.assert_close(out[b : b + 1], o_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(ent[b : b + 1], h_ref, atol=ATOL, rtol=0)


def test_paged_decode_refuses_what_it_does_not_run():
    k_pages, v_pages, table, seq_lens, _, _ = _paged(1, 16, [20])
    q = torch.randn(1, 2, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode(q, k_pages[:, :, :12], v_pages[:, :, :12], table, seq_lens, norm="softmax")


class _RecordGrids:
    """Stands in for a Triton kernel: records each launch's grid and runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("path", ["paged", "split-k"])
def test_entmax_decode_finds_each_rows_threshold_in_its_own_program(path, monkeypatch):
    """A decode step has few rows (B·Hq): its threshold step takes one program per row, not 16 rows a program —
    which left all but 2 of an H200's SMs idle on one sequence of 32 heads (paged entmax 8× ssmax's time there)."""
    import importlib

    host = importlib.import_module("sharp.plugins.triton.attention")  # find_thresholds launches it for both paths

    record = _RecordGrids(host._entmax_threshold_kernel)
    monkeypatch.setattr(host, "_entmax_threshold_kernel", record)
    hq, hkv, lq = 4, 2, 1
    k_pages, v_pages, table, seq_lens, ks, vs = _paged(hkv, 16, LENGTHS, seed=1)
    q = torch.randn(len(LENGTHS), hq, lq, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    if path == "paged":
        out, _ = paged_decode(q, k_pages, v_pages, table, seq_lens, norm="entmax", alpha=1.5)
        refs = [attend(q[b : b + 1], ks[b], vs[b], norm="entmax", causal=True, alpha=1.5) for b in range(len(LENGTHS))]
        torch.testing.assert_close(out, torch.cat(refs), atol=ATOL, rtol=0)
    else:
        out = attend(q[:1], ks[0], vs[0], norm="entmax", causal=True, alpha=1.5, impl="triton")
        torch.testing.assert_close(out, attend(q[:1], ks[0], vs[0], norm="entmax", causal=True, alpha=1.5), atol=ATOL,
                                   rtol=0)  # fmt: skip
    rows = hq * lq * (len(LENGTHS) if path == "paged" else 1)
    assert [grid[0] for grid in record.grids] == [rows]
