"""Paged decode (plugins/triton/paged.py) against `attend` on each sequence's gathered keys: shuffled block tables,
partly filled last pages, GQA packed into the rows, several splits, every softmax-family norm. CPU: interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

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
    return k_pages, v_pages, table, torch.tensor(lengths, dtype=torch.int32), ks, vs


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
    return kw


@pytest.mark.parametrize("norm", ["softmax", "ssmax", "ssa", "adaptive", "entmax", "asentmax"])
@pytest.mark.parametrize(("hq", "hkv", "lq"), [(4, 1, 1), (4, 2, 3), (2, 2, 1)])
@pytest.mark.parametrize("splits", [None, 2])
def test_paged_decode_matches_attend_on_gathered_keys(norm, hq, hkv, lq, splits):
    d = 24  # not a power of two: masked lanes
    lengths = [max(n, lq) for n in LENGTHS]
    k_pages, v_pages, table, seq_lens, ks, vs = _paged(hkv, d, lengths, seed=hq + lq)
    q = torch.randn(len(lengths), hq, lq, d, generator=torch.Generator().manual_seed(9))
    kw = _params(norm, hq, q)
    out, ent = paged_decode(q, k_pages, v_pages, table, seq_lens, norm=norm, splits=splits, **kw)
    for b in range(len(lengths)):
        one = {**kw, "query_scale": kw["query_scale"][b : b + 1]} if "query_scale" in kw else kw
        o_ref, h_ref = attend(q[b : b + 1], ks[b], vs[b], norm=norm, causal=True, return_entropy=True, **one)
        torch.testing.assert_close(out[b : b + 1], o_ref, atol=1e-5, rtol=0, msg=f"sequence {b}")
        torch.testing.assert_close(ent[b : b + 1], h_ref, atol=1e-5, rtol=0, msg=f"sequence {b}")


def test_paged_decode_refuses_what_it_does_not_run():
    k_pages, v_pages, table, seq_lens, _, _ = _paged(1, 16, [20])
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode(q, k_pages[:, :, :12], v_pages[:, :, :12], table, seq_lens, norm="softmax")


_COMPILE_ALL = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sharp.plugins.triton import kernels, paged

SIZES = {"H", "GROUP", "LQ", "LK", "D", "BH", "NPOLY", "B", "HKV", "ROWS", "SPLITS", "WIDTH"}
FLOATS = {"scale", "beta_threshold", "tol"}


def signature(fn, constexprs, pointers):
    out = {}
    for a in fn.arg_names:
        if a in constexprs:
            out[a] = "constexpr"
        elif a in pointers:
            out[a] = pointers[a]
        elif a[0].isupper() and a not in SIZES:
            out[a] = "*fp32"
        else:
            out[a] = "fp32" if a in FLOATS else "i32"
    return out


common = dict(CAUSAL=True, HAS_ALIBI=True, HAS_LAMBDA=True, HAS_KMASK=True, DOT_F32=False, BLOCK_M=16, BLOCK_N=64,
              BLOCK_D=128)
half = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "OUT": "*bf16", "KMASK": "*i8", "COUNTS": "*i32",
        "SKIPPED_OUT": "*i32", "KP": "*bf16", "VP": "*bf16", "BT": "*i32", "SEQ": "*i32"}
cases = [
    (kernels._softmax_family_kernel, dict(common, SSA=False, HAS_ROWF=True, LOGN=True, ADAPTIVE=False,
                                          FINALIZE=False, WITH_V=True)),
    (kernels._softmax_family_kernel, dict(common, SSA=False, HAS_ROWF=False, LOGN=False, ADAPTIVE=True,
                                          FINALIZE=True, WITH_V=True)),
    (kernels._entmax_kernel, dict(common, FAST=2, COUNT=True)),
    (kernels._entmax_kernel, dict(common, FAST=0, COUNT=False)),
    (kernels._entmax_logits_kernel, common),
    (kernels._entmax_threshold_kernel, dict(FAST=1, COUNT=True, BLOCK_R=16, BLOCK_N=64)),
    (kernels._entmax_output_kernel, dict(common, FAST=0)),
    (paged._paged_softmax_kernel, dict(SSA=True, LOGN=False, HAS_ROWF=True, HAS_ALIBI=True, CAUSAL=True,
                                       WITH_V=True, DOT_F32=False, BLOCK_M=16, PAGE=16, BLOCK_D=128)),
    (paged._merge_softmax_kernel, dict(WITH_V=True, BLOCK_R=16, BLOCK_D=128)),
    (paged._paged_entmax_logits_kernel, dict(HAS_ALIBI=True, HAS_LAMBDA=True, CAUSAL=True, DOT_F32=False,
                                             BLOCK_M=16, PAGE=64, BLOCK_D=128)),
    (paged._paged_entmax_output_kernel, dict(FAST=2, DOT_F32=False, BLOCK_M=16, PAGE=64, BLOCK_D=128)),
]
for fn, constexprs in cases:
    src = ASTSource(fn=fn, signature=signature(fn, constexprs, half), constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"ptx_version": 90})
    print(fn.__name__, "compiled")
"""


def test_every_torch_path_kernel_compiles_for_sm90():
    """The interpreter accepts code the GPU compiler rejects (and the reverse): the torch path's kernels — the
    one-launch entmax with its on-chip loop, split-K entmax, paged decode (both families) and its merge — compile
    for sm_90 in bf16 at head dim 128 (the TensorRT entry points are compiled by the AOT tests)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ALL], capture_output=True, text=True, env=env,
                          timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 11
