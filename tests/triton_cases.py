"""Inputs for the Triton kernels' tests (tests/test_triton*.py): random q, k, v, a problem with every norm's
defaults, a norm's keyword arguments (per head or not). Import after `pytest.importorskip("triton")`."""

from __future__ import annotations

import importlib

import torch
from devices import DEVICE, on_device

from sharp.models.problem import build_problem

host = importlib.import_module(
    "sharp.plugins.triton.attention"
)  # the module (the package exports a function of that name)


def qkv(b=1, hq=4, hkv=2, lq=21, lk=45, d=16, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g)
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, d, generator=g)
    qs = torch.rand(b, hq, lq, generator=g) + 0.5
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), qs.to(device)


def problem(q, k, v, **kw):
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


def norm_kwargs(norm, hq, qs, per_head):
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
