"""Positional encodings (docs/attention.md): RoPE (rotate-half, linear scaling), ALiBi slopes, NoPE, NAPE."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sharp.models.config import POSITIONAL


def rope_angles(
    positions: Tensor,
    head_dim: int,
    base: float = 10000.0,
    scaling: float = 1.0,
    inv_freq: Tensor | None = None,
    factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """cos/sin (…, L, head_dim) for absolute positions; linear scaling divides positions by `scaling`. A model's own
    frequencies (`inv_freq`, head_dim / 2 of them: a Hugging Face config's scaled RoPE, computed once by
    transformers) replace base^(−2i/D); `factor` (YaRN's attention factor) multiplies cos and sin."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    if inv_freq is None:
        inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = (positions.to(torch.float32) / scaling).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, L, D) by angles (B or 1, L, D) in the rotate-half convention (LLaMA / Hugging Face)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


def alibi_slopes(heads: int) -> Tensor:
    """Press et al.'s geometric slopes 2^(−8h/H), extended by interleaving for non-powers of two. Positive:
    `attend` adds `slope · (j − i)`, which is ≤ 0 for past keys, so distant keys are penalised."""

    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(heads))
    slopes = powers(closest) + powers(2 * closest)[0::2][: heads - closest]
    return torch.tensor(slopes)


def nape_slopes(heads: int) -> Tensor:
    """NAPE (Vasylenko et al.): heads 0…H/2−1 get ALiBi slopes 1/1, 1/2, …, 1/(H/2); the rest are NoPE."""
    half = heads // 2
    return torch.tensor([1.0 / (h + 1) for h in range(half)] + [0.0] * (heads - half))


def slopes_for(pos: str, heads: int) -> Tensor | None:
    if pos not in POSITIONAL:
        raise ValueError(f"unknown positional encoding {pos!r}; valid: {', '.join(POSITIONAL)}")
    return {"alibi": alibi_slopes, "nape": nape_slopes}.get(pos, lambda _: None)(heads)


def head_length_scale(keys: Tensor, scaled: Tensor, scaled_from: int) -> Tensor:
    """The factor on the queries of length-scaled heads (ModelConfig.scaled_heads), (B, Hq, L, 1): SSMax's
    log n / log scaled_from floored at 1 on the heads `scaled` (Hq,) marks, 1 on the others. `keys` (B, L) is how
    many keys each query sees (its position + 1 without padding). The floor keeps every head exactly as trained up to
    scaled_from keys; past it a scaled head's logits grow with log n, as SSMax's do, so its weights stop dispersing."""
    factor = torch.clamp(torch.log(keys.to(torch.float32)) / math.log(scaled_from), min=1.0)
    return torch.where(scaled[None, :, None, None], factor[:, None, :, None], torch.ones((), device=keys.device))
