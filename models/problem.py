"""One validated attention problem: shapes, positions, per-head parameters and the logits of any tile.

Every implementation of `attend` (reference, streamed, kernels) starts from this, so masking, causal
alignment (query i sits at key position Lk − Lq + i), GQA, ALiBi and ASEntmax's λ mean the same everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sharp.models import registry
from sharp.models.normalizers import Param, compute_dtype
from sharp.models.registry import Family, Norm

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class AttentionProblem:
    """Inputs of one `attend` call, checked, with per-head parameters as (1, Hq, 1, 1) tensors (or floats)."""

    q: Tensor
    k: Tensor
    v: Tensor
    norm: Norm
    causal: bool
    scale: float
    alpha: Param
    ssa_n: Param
    ssa_b: Param
    ssmax_s: Param
    poly: tuple[float, ...]
    query_scale: Tensor | None
    alibi_slopes: Tensor | None
    key_mask: Tensor | None = None  # (B, Lk) bool, True = the key exists (False: padding)
    # The algorithm that runs, decided once by build_problem (it reads α): entmax with α = 1 everywhere is softmax;
    # None when per-head α mixes 1 with α > 1 (only the reference runs that, row by row).
    mixed_family: Family | None = Family.SOFTMAX

    @property
    def family(self) -> Family:
        """The one algorithm a streamed implementation runs for every head of the call."""
        if self.mixed_family is None:
            raise ValueError("streamed attention cannot mix alpha == 1 (softmax) with alpha > 1 across heads")
        return self.mixed_family

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def lq(self) -> int:
        return self.q.shape[2]

    @property
    def lk(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the math runs in (fp32 for half inputs)."""
        return compute_dtype(self.q.dtype)

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    @property
    def params(self) -> dict[str, Param]:
        """The norm's own per-head parameters, by name."""
        return {p.name: getattr(self, p.name) for p in self.norm.params}

    def query_positions(self, start: int = 0, stop: int | None = None) -> Tensor:
        """Absolute positions of queries [start, stop): the KV cache holds the Lk − Lq earlier tokens."""
        stop = self.lq if stop is None else stop
        return torch.arange(start, stop, device=self.q.device) + (self.lk - self.lq)

    def visible_keys(self, qpos: Tensor) -> Tensor:
        """Number of keys each query sees (its ssmax n), as a float column (1 or B, 1, Lq_chunk, 1)."""
        if self.key_mask is None:
            n = qpos + 1 if self.causal else torch.full_like(qpos, self.lk)
            return n.to(self.dtype).view(1, 1, -1, 1)
        seen = self.key_mask.to(torch.int64).cumsum(-1)  # (B, Lk): keys present up to each position
        n = seen[:, qpos] if self.causal else seen[:, -1:].expand(-1, qpos.numel())
        return n.clamp_min(1).to(self.dtype).view(self.batch, 1, -1, 1)  # an all-padding row stays finite

    def expand_kv(self, t: Tensor) -> Tensor:
        """GQA: query head h reads KV head h // (Hq / Hkv)."""
        return t if self.group == 1 else t.repeat_interleave(self.group, dim=1)

    def logits(self, q_start: int, q_stop: int, k_start: int, k_stop: int) -> Tensor:
        """Final logits z (B, Hq, q rows, k cols) in the compute dtype: scale·q·k, + ALiBi, × λ, causal −inf."""
        dt = self.dtype
        qb = self.q[:, :, q_start:q_stop].to(dt)
        kb = self.expand_kv(self.k[:, :, k_start:k_stop].to(dt))
        z = torch.matmul(qb, kb.transpose(-1, -2)) * self.scale
        qpos = self.query_positions(q_start, q_stop)
        kpos = torch.arange(k_start, k_stop, device=z.device)
        if self.alibi_slopes is not None:
            rel = (kpos.view(1, -1) - qpos.view(-1, 1)).to(dt)
            z = z + self.alibi_slopes.to(dt).view(1, -1, 1, 1) * rel
        if self.query_scale is not None:
            z = z * self.query_scale[:, :, q_start:q_stop, None].to(dt)
        if self.causal:
            z = z.masked_fill(kpos.view(1, -1) > qpos.view(-1, 1), _NEG_INF)
        if self.key_mask is not None:
            z = z.masked_fill(~self.key_mask[:, None, None, k_start:k_stop], _NEG_INF)
        return z

    def values(self, k_start: int, k_stop: int) -> Tensor:
        return self.expand_kv(self.v[:, :, k_start:k_stop].to(self.dtype))


def _head_param(name: str, value: Param, heads: int, like: Tensor) -> Param:
    """A float stays a float (exact fast paths); a tensor must be a scalar or per head (Hq,)."""
    if not isinstance(value, Tensor):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
        return value
    if value.numel() == 1:
        return value.reshape(1, 1, 1, 1).to(compute_dtype(like.dtype))
    if value.shape != (heads,):
        raise ValueError(f"{name} must be a float, a scalar tensor or shape ({heads},), got {tuple(value.shape)}")
    return value.reshape(1, heads, 1, 1).to(compute_dtype(like.dtype))


def build_problem(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    norm: str,
    causal: bool,
    scale: float | None,
    alpha: Param,
    ssa_n: Param,
    ssa_b: Param,
    ssmax_s: Param,
    poly: tuple[float, ...] | Tensor,
    query_scale: Tensor | None,
    alibi_slopes: Tensor | None,
    key_mask: Tensor | None = None,
) -> AttentionProblem:
    """Check shapes and values; errors say what was found and what is allowed."""
    spec = registry.get(norm)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, H, L, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    b, hq, lq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[-1] != d:
        raise ValueError(f"q and k head dims differ: {d} vs {k.shape[-1]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k and v must share (Hkv, Lk), got {tuple(k.shape[1:3])} and {tuple(v.shape[1:3])}")
    hkv = k.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"GQA needs Hq % Hkv == 0, got Hq={hq}, Hkv={hkv}")
    if causal and lq > k.shape[2]:
        raise ValueError(f"causal attention needs Lq <= Lk, got Lq={lq}, Lk={k.shape[2]}")
    if spec.query_scale and query_scale is None:
        raise ValueError(f"norm={norm!r} needs query_scale (B, Hq, Lq): its per-query scale λ")
    if query_scale is not None and tuple(query_scale.shape) != (b, hq, lq):
        raise ValueError(f"query_scale must be (B, Hq, Lq) = {(b, hq, lq)}, got {tuple(query_scale.shape)}")
    if key_mask is not None and (tuple(key_mask.shape) != (b, k.shape[2]) or key_mask.dtype != torch.bool):
        raise ValueError(
            f"key_mask must be bool (B, Lk) = {(b, k.shape[2])}, got {key_mask.dtype} {tuple(key_mask.shape)}"
        )
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (hq,):
        raise ValueError(f"alibi_slopes must be ({hq},), got {tuple(alibi_slopes.shape)}")
    given = {"alpha": alpha, "ssa_n": ssa_n, "ssa_b": ssa_b, "ssmax_s": ssmax_s}
    params = {name: _head_param(name, value, hq, q) for name, value in given.items()}
    for p in spec.params:  # the domain is checked for the parameters the norm reads
        value = params[p.name]
        if isinstance(value, float):
            if (why := p.problem(value)) is not None:
                raise ValueError(why)
        else:
            p.check_tensor(value)
    poly_t = tuple(float(c) for c in (poly.tolist() if isinstance(poly, Tensor) else poly))
    family = _family(spec, params["alpha"])
    return AttentionProblem(
        q=q,
        k=k,
        v=v,
        norm=spec,
        causal=causal,
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(d),
        **params,
        poly=poly_t,
        query_scale=query_scale,
        alibi_slopes=alibi_slopes,
        key_mask=key_mask,
        mixed_family=family,
    )


def _family(spec: Norm, alpha: Param) -> Family | None:
    """Entmax with α = 1 everywhere is softmax; None for per-head α mixing 1 with α > 1. Decided here, with the
    other value checks, so that the kernels' host code never reads a device value."""
    if spec.family is not Family.ENTMAX:
        return spec.family
    if isinstance(alpha, float):
        return Family.SOFTMAX if alpha == 1.0 else Family.ENTMAX
    ones = alpha == 1.0
    if bool(ones.any()) and not bool(ones.all()):
        return None
    return Family.SOFTMAX if bool(ones.all()) else Family.ENTMAX
