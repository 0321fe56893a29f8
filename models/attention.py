"""`attend`: the one entry point for attention with any sharp normalizer and any implementation.

impl="reference" materialises the (B, Hq, Lq, Lk) logits and is differentiable (the training path);
impl="streamed" runs the blockwise algorithms of docs/attention.md with O(Lq·block) extra memory (forward only);
impl="sdpa" hands the norms whose transform is a per-row scale of the logits (softmax, SSMax) to torch's fused
scaled_dot_product_attention, the scale folded into the queries (forward, no entropy);
further implementations (GPU kernels) plug in through the `sharp.attention_impls` entry-point group, so
this layer never imports the layers above it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import entry_points

import torch
from torch import Tensor

from sharp.models.normalizers import PAPER_POLY, Param, entropy
from sharp.models.problem import AttentionProblem, build_problem
from sharp.models.registry import ALPHA, SSA_B, SSA_N, SSMAX_S, Family, Transform, all_norms, get
from sharp.models.streamed import QUERY_CHUNK, streamed_attention

ImplFn = Callable[..., tuple[Tensor, Tensor | None]]  # (problem, block_size, entropy) → (output, entropy or None)
STREAMED_BLOCK = 128  # keys per block of impl="streamed" when block_size is not given
BUILTIN_IMPLS: tuple[str, ...] = ("reference", "streamed", "sdpa")  # in this layer; others come by entry point
ROW_SCALED = (Transform.IDENTITY, Transform.LOG_N_SCALE)  # transforms that multiply a row's logits by one number


def _reference(problem: AttentionProblem, block_size: int | None, with_entropy: bool) -> tuple[Tensor, Tensor]:
    p = problem
    z = p.logits(0, p.lq, 0, p.lk)
    probs = p.norm.probs(z, -1, poly=p.poly, **p.params)
    return torch.matmul(probs, p.values(0, p.lk)), entropy(probs)


def _streamed(problem: AttentionProblem, block_size: int | None, with_entropy: bool) -> tuple[Tensor, Tensor]:
    if torch.is_grad_enabled() and any(
        t.requires_grad for t in (problem.q, problem.k, problem.v) if isinstance(t, Tensor)
    ):
        raise ValueError("impl='streamed' is forward-only (inference); train with impl='reference'")
    return streamed_attention(problem, block_size or STREAMED_BLOCK)


def sdpa_runs(norm: str) -> bool:
    """Whether impl="sdpa" computes `norm`: a softmax whose transform scales each row's logits by one number."""
    spec = get(norm)
    return spec.family is Family.SOFTMAX and spec.transform in ROW_SCALED


def _sdpa(problem: AttentionProblem, block_size: int | None, with_entropy: bool) -> tuple[Tensor, None]:
    """softmax(f·z) = softmax of (f·λ·scale·q)·k + f·λ·ALiBi, with f the row's factor (1, or SSMax's s·log n) and λ
    the per-query scale: one fused call when nothing but causality masks (Lq = Lk), else QUERY_CHUNK rows at a time
    with an additive mask. A row that sees no key gives zeros, as the reference's (torch's SDPA does so; tested)."""
    p = problem
    if with_entropy:
        raise ValueError("impl='sdpa' gives no entropy; ask impl='streamed' or 'reference' for it")
    if not sdpa_runs(p.norm.name):
        allowed = ", ".join(n.name for n in all_norms() if sdpa_runs(n.name))
        raise ValueError(f"impl='sdpa' runs {allowed}; {p.norm.name} needs impl='reference' or 'streamed'")
    dt = p.dtype
    out = torch.empty(*p.q.shape[:3], p.v.shape[-1], dtype=dt, device=p.q.device)
    k, v = p.k.to(dt), p.v.to(dt)
    kpos = torch.arange(p.lk, device=p.q.device)
    whole = p.alibi_slopes is None and p.key_mask is None and (not p.causal or p.lq == p.lk)
    rows = max(1, p.lq) if whole else QUERY_CHUNK
    for start in range(0, p.lq, rows):
        stop = min(p.lq, start + rows)
        qpos = p.query_positions(start, stop)
        factor: Tensor | float = 1.0
        if p.norm.transform is Transform.LOG_N_SCALE:
            factor = p.ssmax_s * torch.log(p.visible_keys(qpos))
        if p.query_scale is not None:
            factor = factor * p.query_scale[:, :, start:stop, None].to(dt)
        q = p.q[:, :, start:stop].to(dt) * (factor * p.scale)
        mask = None
        if not whole:
            mask = torch.zeros(1, 1, stop - start, p.lk, dtype=dt, device=p.q.device)
            if p.alibi_slopes is not None:
                rel = (kpos.view(1, -1) - qpos.view(-1, 1)).to(dt)
                mask = factor * p.alibi_slopes.to(dt).view(1, -1, 1, 1) * rel
            hidden = torch.zeros(1, 1, 1, p.lk, dtype=torch.bool, device=p.q.device)
            if p.causal:
                hidden = hidden | (kpos.view(1, 1, 1, -1) > qpos.view(1, 1, -1, 1))
            if p.key_mask is not None:
                hidden = hidden | ~p.key_mask[:, None, None, :]
            mask = torch.where(hidden, float("-inf"), mask)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=whole and p.causal, scale=1.0, enable_gqa=p.group > 1
        )
        out[:, :, start:stop] = o
    return out, None


IMPL_GROUP = "sharp.attention_impls"  # attend(impl=NAME)
PAGED_IMPL_GROUP = "sharp.paged_attention_impls"  # paged attention over a KV cache's pages (models/kvcache.py)


def available_impls() -> tuple[str, ...]:
    """Every `impl` attend takes here: the built-in ones, then those installed packages register in the
    `sharp.attention_impls` entry-point group (sharp's own Triton kernels as "triton", or a third party's)."""
    installed = sorted({ep.name for ep in entry_points(group=IMPL_GROUP)} - set(BUILTIN_IMPLS))
    return (*BUILTIN_IMPLS, *installed)


@functools.cache
def registered_impl(group: str, name: str) -> ImplFn:
    """The implementation a higher layer (e.g. sharp.plugins.triton) registers as entry point `name` of `group`,
    resolved once per process: scanning the installed packages' entry points costs milliseconds per call, more
    than a GPU decode step. A missing one is not remembered (installing it later works)."""
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        raise ValueError(f"{name!r} is not installed here for {group} (pip install 'sharp-attention[kernels]')")
    return found[0].load()


@functools.cache
def _installed() -> tuple:
    """The entry points of the impl group, scanned once (a scan costs milliseconds: more than a decode step)."""
    return tuple(entry_points(group=IMPL_GROUP))


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    norm: str = "softmax",
    causal: bool = False,
    scale: float | None = None,
    alpha: Param = ALPHA.default,
    ssa_n: Param = SSA_N.default,
    ssa_b: Param = SSA_B.default,
    ssmax_s: Param = SSMAX_S.default,
    poly: tuple[float, ...] | Tensor = PAPER_POLY,
    query_scale: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    key_mask: Tensor | None = None,
    impl: str = "reference",
    block_size: int | None = None,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention O = P V with P = norm(logits) (docs/attention.md).

    q (B, Hq, Lq, D); k, v (B, Hkv, Lk, D), Hq % Hkv == 0 (GQA). With Lq ≤ Lk, query i sits at position
    Lk − Lq + i. Parameters are floats or per-head (Hq,) tensors. `query_scale` (B, Hq, Lq) multiplies the
    final logits (ASEntmax's λ; norm="asentmax" requires it); `alibi_slopes` (Hq,) adds slope·(j − i);
    `key_mask` (B, Lk) bool hides padding keys (False) from every query. `block_size` is the key tile of the
    streamed (default 128) and Triton (default: its own choice, tuned on CUDA) implementations.
    Returns the output (B, Hq, Lq, D) in q's dtype, and with `return_entropy` the entropy (B, Hq, Lq) in
    nats of each attention row, in the compute dtype (fp32 for half inputs).
    """
    if impl not in BUILTIN_IMPLS and not any(ep.name == impl for ep in _installed()):
        raise ValueError(f"unknown impl {impl!r}; valid: {', '.join(available_impls())}")
    problem = build_problem(
        q,
        k,
        v,
        norm=norm,
        causal=causal,
        scale=scale,
        alpha=alpha,
        ssa_n=ssa_n,
        ssa_b=ssa_b,
        ssmax_s=ssmax_s,
        poly=poly,
        query_scale=query_scale,
        alibi_slopes=alibi_slopes,
        key_mask=key_mask,
    )
    if problem.lk == 0:
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        ent = torch.zeros(q.shape[:3], dtype=problem.dtype, device=q.device)
    else:
        builtin = {"reference": _reference, "streamed": _streamed, "sdpa": _sdpa}
        run: ImplFn = builtin.get(impl) or registered_impl(IMPL_GROUP, impl)
        out, ent = run(problem, block_size, return_entropy)  # an impl may skip the entropy when not asked
    out = out.to(q.dtype)
    return (out, ent) if return_entropy else out
