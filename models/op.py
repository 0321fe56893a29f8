"""`torch.ops.sharp.attention`: attention as one opaque PyTorch op, so graph capture (torch.export, ONNX
export) sees a single node per layer instead of the normalizer's internals.

Its slots mirror the ONNX op contract (docs/op.md): every tensor is always passed — parameters a norm does
not use are ignored — so the op has one fixed signature. Eager calls run the reference implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sharp.models import registry
from sharp.models.attention import attend


@torch.library.custom_op("sharp::attention", mutates_args=())
def sharp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor,
    alibi_slopes: Tensor,
    alpha: Tensor,
    query_scale: Tensor,
    ssa_n: Tensor,
    ssa_b: Tensor,
    ssmax_s: Tensor,
    norm: str,
    causal: bool,
    scale: float,
    poly: list[float],
) -> tuple[Tensor, Tensor]:
    out, ent = attend(
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
        poly=tuple(poly),
        query_scale=query_scale if registry.get(norm).query_scale else None,
        alibi_slopes=alibi_slopes,
        key_mask=key_mask,
        return_entropy=True,
    )
    return out.contiguous(), ent.to(torch.float32).contiguous()


@sharp_attention.register_fake
def _(q, k, v, key_mask, alibi_slopes, alpha, query_scale, ssa_n, ssa_b, ssmax_s, norm, causal, scale, poly):
    b, h, lq, _ = q.shape
    return q.new_empty((b, h, lq, v.shape[-1])), q.new_empty((b, h, lq), dtype=torch.float32)


def attend_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    norm: str,
    key_mask: Tensor,
    alibi_slopes: Tensor | None,
    scale: float,
    poly: tuple[float, ...],
    causal: bool = True,
    alpha: Tensor | None = None,
    query_scale: Tensor | None = None,
    ssa_n: Tensor | None = None,
    ssa_b: Tensor | None = None,
    ssmax_s: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Call the op with `attend`-style optional parameters, filling unused slots with the registry's defaults."""
    heads = q.shape[1]

    def per_head(t: Tensor | None, default: float) -> Tensor:
        return torch.full((heads,), default, dtype=torch.float32, device=q.device) if t is None else t.float()

    given = {"alpha": alpha, "ssa_n": ssa_n, "ssa_b": ssa_b, "ssmax_s": ssmax_s}
    slot = {p.name: per_head(given[p.name], p.default) for p in registry.HEAD_PARAMS}
    return sharp_attention(
        q,
        k,
        v,
        key_mask,
        per_head(alibi_slopes, 0.0),
        slot["alpha"],
        query_scale.float() if query_scale is not None else torch.ones(q.shape[:3], device=q.device),
        slot["ssa_n"],
        slot["ssa_b"],
        slot["ssmax_s"],
        norm,
        causal,
        float(scale),
        [float(c) for c in poly],
    )
