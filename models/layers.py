"""Transformer building blocks: RMSNorm, the MLP, and SharpAttention (self-attention over `attend`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharp.models import registry
from sharp.models.attention import attend
from sharp.models.config import ModelConfig
from sharp.models.kvcache import PagedLayer
from sharp.models.op import attend_op
from sharp.models.positional import apply_rope, head_length_scale, rope_angles, slopes_for

KVCache = tuple[Tensor, Tensor]  # (k, v), each (B, Hkv, L_past, head_dim), keys already rotated


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """x / sqrt(mean(x²) + eps) · weight, written with a division (not rsqrt): onnxruntime fuses exactly this
        exported form into one SimplifiedLayerNormalization node (a decode step's graph: 221 → 167 nodes)."""
        xf = x.float()
        return (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def make_layer_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.dim
    if cfg.layer_norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps or 1e-6)
    return nn.LayerNorm(dim, cfg.norm_eps or 1e-5)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            hidden = cfg.mlp_hidden or 8 * ((8 * cfg.dim // 3 + 7) // 8)
            self.gate = nn.Linear(cfg.dim, hidden, bias=False)
        else:
            hidden = cfg.mlp_hidden or 4 * cfg.dim
        self.up = nn.Linear(cfg.dim, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.gate(x)) * self.up(x) if self.kind == "swiglu" else F.gelu(self.up(x))
        return self.down(h)


AttentionFn = Callable[..., tuple[Tensor, Tensor | None]]


def library_attention(
    q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None, impl: str, entropy: bool, **kw
) -> tuple[Tensor, Tensor | None]:
    """`attend` (any implementation registered for impl=), causal, scale 1/√D: the output and, when asked, the
    entropy."""
    res = attend(q, k, v, causal=True, key_mask=key_mask, impl=impl, return_entropy=entropy, **kw)
    return res if entropy else (res, None)


def op_attention(
    q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None, impl: str, entropy: bool, **kw
) -> tuple[Tensor, Tensor | None]:
    """One opaque torch.ops.sharp.attention node per layer, for graph capture (the exporter lowers it to
    SharpAttention; impl is the runtime's choice): the output and the entropy, always (an output of the node)."""
    if key_mask is None:
        key_mask = torch.ones(q.shape[0], k.shape[2], dtype=torch.bool, device=q.device)
    return attend_op(q, k, v, key_mask=key_mask, scale=q.shape[-1] ** -0.5, **kw)


class SharpAttention(nn.Module):
    """Causal multi-head / grouped-query self-attention with a sharp normalizer and per-head parameters.

    The norm's per-head parameters come from the registry (how each is stored, its initial value in the
    config, whether it learns); a norm with a per-query scale (ASEntmax) computes λ = δ + β·log(pos + 2)^γ per
    query from its hidden state with β = softplus(x·w_β), γ = s_γ·tanh(x·w_γ). `attention` is the function that
    attends over a dense cache: `library_attention` (default) or `op_attention` (for export; `use_custom_op`).
    """

    def __init__(self, cfg: ModelConfig, norm: str, attention: AttentionFn = library_attention, layer: int = 0):
        super().__init__()
        self.cfg, self.norm, self.attention = cfg, norm, attention
        self.spec = registry.get(norm)
        h, hkv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.dim, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = make_layer_norm(cfg, d), make_layer_norm(cfg, d)
        self._inv_freq: dict[torch.device, Tensor] = {}  # fp32 always: not a buffer, which .to(bf16) would round
        for p in self.spec.params:
            raw = torch.full((h,), p.to_raw(float(getattr(cfg, p.config_field))))
            if p.learn_flag is None or getattr(cfg, p.learn_flag):
                setattr(self, p.state_name, nn.Parameter(raw))
            else:
                self.register_buffer(p.state_name, raw)
        if self.spec.query_scale:
            self.w_beta = nn.Linear(cfg.dim, h)
            self.w_gamma = nn.Linear(cfg.dim, h)
            for lin in (self.w_beta, self.w_gamma):
                nn.init.normal_(lin.weight, std=0.02)
                nn.init.zeros_(lin.bias)
        slopes = slopes_for(cfg.pos, h)
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        scaled = [i - layer * h for i in cfg.scaled_heads if layer * h <= i < (layer + 1) * h]
        mask = torch.zeros(h, dtype=torch.bool, device="cpu")  # on the CPU even when the model is built on "meta"
        mask[scaled] = True
        self.register_buffer("scaled_heads", mask if scaled else None, persistent=False)  # this layer's length-scaled

    def head_params(self) -> dict[str, Tensor]:
        """The per-head normalizer parameters `attend` receives (Hq,)."""
        return {p.name: p.from_raw(getattr(self, p.state_name)) for p in self.spec.params}

    def inv_freq(self, device: torch.device) -> Tensor | None:
        """The model's own RoPE frequencies in fp32 on `device` (None: RoPE's base^(−2i/D))."""
        if self.cfg.rope_inv_freq is None:
            return None
        if device not in self._inv_freq:
            self._inv_freq[device] = torch.tensor(self.cfg.rope_inv_freq, dtype=torch.float32, device=device)
        return self._inv_freq[device]

    def llama4_scale(self, positions: Tensor) -> Tensor:
        """Llama 4's (and Ministral 3's) query temperature 1 + β·log(1 + ⌊pos / floor⌋), (B, 1, L, 1)."""
        cfg = self.cfg
        scale = 1 + cfg.llama4_beta * torch.log(1 + torch.floor(positions.to(torch.float32) / cfg.llama4_floor))
        return scale[:, None, :, None]

    def query_scale(self, x: Tensor, positions: Tensor) -> Tensor:
        """ASEntmax's λ (B, Hq, L) from the hidden states entering the layer and absolute positions (B, L)."""
        beta = F.softplus(self.w_beta(x))
        gamma = self.cfg.asentmax_s_gamma * torch.tanh(self.w_gamma(x))
        logpos = torch.log(positions.to(x.dtype) + 2.0).unsqueeze(-1)
        return (self.cfg.asentmax_delta + beta * logpos.pow(gamma)).transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        cache: KVCache | PagedLayer | None = None,
        key_mask: Tensor | None = None,
        impl: str = "reference",
        entropy: bool = True,
    ) -> tuple[Tensor, KVCache | PagedLayer, Tensor | None]:
        """x (B, L, dim), positions (B, L) → output (B, L, dim), the new cache, entropy (B, Hq, L) — or None when
        not asked for and the attention can skip it (the Triton kernels do).

        With a dense cache the new keys are concatenated to it (and returned); with a paged cache they are written
        into the sequences' pages (key_mask unused: a paged sequence has no padding)."""
        b, length, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, length, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, length, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, length, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.pos == "rope":
            freq, factor = self.inv_freq(x.device), cfg.rope_attention_factor
            cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_base, cfg.rope_scaling, freq, factor)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cfg.llama4_beta:
            q = q * self.llama4_scale(positions).to(q.dtype)
        if self.scaled_heads is not None:
            q = q * head_length_scale(positions + 1, self.scaled_heads, cfg.scaled_from).to(q.dtype)
        if isinstance(cache, PagedLayer):
            cache.write(k, v)
        elif cache is not None:
            k = torch.cat((cache[0], k), dim=2)
            v = torch.cat((cache[1], v), dim=2)
        kwargs = dict(
            norm=self.norm,
            poly=cfg.adaptive_poly,
            query_scale=self.query_scale(x, positions) if self.spec.query_scale else None,
            alibi_slopes=self.alibi_slopes,
            **self.head_params(),
        )
        if isinstance(cache, PagedLayer):
            out, ent = cache.attend(q, impl, entropy=entropy, **kwargs)
        else:
            out, ent = self.attention(q, k, v, key_mask=key_mask, impl=impl, entropy=entropy, **kwargs)
        out = out.transpose(1, 2).reshape(b, length, cfg.heads * cfg.head_dim)
        return self.o_proj(out), cache if isinstance(cache, PagedLayer) else (k, v), ent


def use_custom_op(model: nn.Module, on: bool = True) -> nn.Module:
    """Give every SharpAttention of `model` `op_attention` (for export) or `library_attention` (default)."""
    for m in model.modules():
        if isinstance(m, SharpAttention):
            m.attention = op_attention if on else library_attention
    return model
